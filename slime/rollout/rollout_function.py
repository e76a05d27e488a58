"""A `--rollout-function-path` function: what it is given (slime's interface: the `data_source` it
draws prompts from, and the built-in rollout it may call, slime.rollout.sglang_rollout.generate_rollout),
and `rollout_function_samples`, which calls it and scores what it returns."""

from __future__ import annotations

import inspect
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slime.config.arguments import Config
from slime.config.eval_sets import EvalDataset
from slime.rollout.base_types import number_groups, unwrap
from slime.rollout.builtin_rollout import GenerationProgress
from slime.rollout.data import PromptDataset
from slime.rollout.rewards import RewardModel, score_unscored
from slime.utils.async_utils import run
from slime.utils.processing_utils import image_train_inputs
from slime.utils.sample import Sample, Status, group_samples


@dataclass
class BuiltInRollout:
    """The rollout (or evaluation set) a rollout function was called for, as the built-in
    rollout makes it: what slime.rollout.sglang_rollout.generate_rollout returns when a user's
    rollout function calls it."""

    rollout_id: int
    evaluation: bool
    eval_set: str | None
    run: Callable[[], tuple[list[Sample], dict[str, float]]]

    def __call__(self, rollout_id: int, evaluation: bool) -> Any:
        from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
        from slime.utils.async_utils import get_async_loop

        if threading.current_thread() is get_async_loop().thread:
            raise RuntimeError(
                "slime.rollout.sglang_rollout.generate_rollout is synchronous: call it from a plain (not "
                "async) --rollout-function-path function"
            )
        if (rollout_id, evaluation) != (self.rollout_id, self.evaluation):
            raise ValueError(
                f"generate_rollout was called for rollout {rollout_id} (evaluation={evaluation}) with the "
                f"data_source of rollout {self.rollout_id} (evaluation={self.evaluation})"
            )
        samples, metrics = self.run()
        if evaluation:
            name = self.eval_set or "eval"
            return RolloutFnEvalOutput(
                data={
                    name: {
                        "rewards": [s.reward for s in samples],
                        "truncated": [s.status == Status.TRUNCATED for s in samples],
                        "samples": samples,
                    }
                },
                metrics=metrics,
            )
        return RolloutFnTrainOutput(samples=group_samples(samples), metrics=metrics)


_BLANK_GROUPS = itertools.count()


def _blank_groups(n: int) -> list[int]:
    """The next `n` group numbers of --disable-rollout-global-dataset's blank samples (per process)."""
    return [next(_BLANK_GROUPS) for _ in range(n)]


class DataSource:
    """What a `--rollout-function-path` function draws prompts from (slime's `data_source`)."""

    def __init__(
        self,
        dataset: PromptDataset | None,
        n_samples_per_prompt: int,
        default_rollout: BuiltInRollout | None = None,
        sample_fields: dict[str, Any] | None = None,
        blank: bool = False,
    ):
        """`sample_fields`: set on every sample drawn (an evaluation set's own `custom_rm_path`
        and `generate_function_path`, as slime sets them). `blank` (--disable-rollout-global-dataset):
        no dataset, groups of blank samples numbered across the job, as slime hands them out."""
        self.dataset = dataset
        self.n_samples_per_prompt = n_samples_per_prompt
        self.default_rollout = default_rollout
        self.sample_fields = {k: v for k, v in (sample_fields or {}).items() if v is not None}
        self.blank = blank

    def get_samples(self, num_prompts: int) -> list[list[Sample]]:
        """The next `num_prompts` prompts, each as a group of n-samples-per-prompt fresh Samples
        (prompt ids in `tokens`, `metadata["prompt_index"]` set)."""
        if self.blank:
            return [
                [
                    Sample(group_index=g, index=g * self.n_samples_per_prompt + i, **self.sample_fields)
                    for i in range(self.n_samples_per_prompt)
                ]
                for g in _blank_groups(num_prompts)
            ]
        if self.dataset is None:
            raise RuntimeError(
                "this job has no --prompt-data: the rollout function must bring its own prompts"
            )
        groups = []
        for p in self.dataset.next_batch(num_prompts):
            # --multimodal-keys: the images (slime's multimodal_inputs) and their tensors for the trainer
            vision: dict[str, Any] = {}
            if p.images:
                vision = {
                    "multimodal_inputs": {"images": list(p.images)},
                    "multimodal_train_inputs": image_train_inputs(self.dataset.processor, list(p.images)),
                }
            groups.append(
                [
                    Sample(
                        prompt=p.prompt,
                        tokens=list(p.token_ids),
                        label=p.label,
                        metadata=dict(p.metadata, prompt_index=p.index),
                        **vision,
                        **self.sample_fields,
                    )
                    for _ in range(self.n_samples_per_prompt)
                ]
            )
        return groups


def rollout_function_samples(
    fn: Callable[..., Any],
    config: Config,
    rollout_id: int,
    dataset: PromptDataset | None,
    reward: RewardModel | None,
    built_in: Callable[[], tuple[list[Sample], dict[str, float]]],
    progress: GenerationProgress,
    eval_ds: EvalDataset | None = None,
) -> tuple[list[Sample], dict[str, float]]:
    """Run the user's rollout function `fn` for a training rollout, or for the evaluation set
    `eval_ds`; score the samples it left without a reward. Returns them and the function's own
    metrics (RolloutFnTrainOutput's). `built_in`: this rollout (or evaluation set) as the
    built-in rollout makes it, for a function that calls
    slime.rollout.sglang_rollout.generate_rollout.

    The function is called from this (synchronous) thread, as slime calls it: slime's own
    rollout functions call `slime.utils.async_utils.run` themselves."""
    flag = "--rollout-function-path"
    evaluation = eval_ds is not None
    eval_set = eval_ds.name if eval_ds is not None else None
    n = (eval_ds or config.rollout).sampling.n_samples_per_prompt
    fields = {}  # slime sets an evaluation set's own functions on its samples
    if eval_ds is not None:
        fields = {
            "custom_rm_path": eval_ds.custom_rm_path,
            "generate_function_path": eval_ds.custom_generate_function_path,
        }
    source = DataSource(
        dataset,
        n,
        BuiltInRollout(rollout_id, evaluation, eval_set, built_in),
        fields,
        blank=not config.rollout.global_dataset and not evaluation,
    )
    result = fn(config.args, rollout_id, source, evaluation=evaluation)
    if inspect.isawaitable(result):
        result = run(result)
    groups_out, fn_metrics = unwrap(result, evaluation, eval_set)
    samples = number_groups(groups_out, n, flag)
    start = time.perf_counter()
    todo = [g for g in group_samples(samples) if any(s.reward is None for s in g)]
    if todo:
        run(_score_groups(reward, todo, flag))
    progress.reward_seconds += time.perf_counter() - start
    return samples, fn_metrics


async def _score_groups(reward: RewardModel | None, groups: list[list[Sample]], flag: str) -> None:
    for group in groups:
        await score_unscored(reward, group, flag)
