"""`slime.rollout.sglang_rollout`: the default rollout's pieces, under the names slime's plugins
import.

- `GenerateState(args)`: one per process (slime.utils.misc.SingletonMeta). It holds the
  tokenizer of `--hf-checkpoint`, the default sampling parameters, a semaphore bounding the
  requests in flight (`--sglang-server-concurrency` per engine), and the bookkeeping slime's
  asynchronous rollout functions use (`pendings`, `remaining_batch_size`, `aborted`, `reset`).
- `generate(args, sample, sampling_params)`: the default generate function. One /generate call
  through the router with the sample's token ids; the response tokens are exactly the engine's
  (`Sample.append_response_tokens`). A custom generate function may call it for each turn.
- `generate_and_rm`, `generate_and_rm_group`: a sample (a group) generated, with the custom
  generate function where one is set, and scored as the default rollout scores it.
- `abort(args, rollout_id)`: aborts every request on the engines, waits for the pending groups,
  and returns them when `--partial-rollout` is set.
- `generate_rollout(args, rollout_id, data_source, evaluation=False)`: slime's default rollout
  function. Named by `--rollout-function-path` it is the built-in rollout itself; called from a
  user's rollout function (with the `data_source` the rollout manager passed in) it runs the
  built-in rollout (over-sampling, the dynamic filter, deterministic seeds, fault tolerance) and
  returns `RolloutFnTrainOutput` / `RolloutFnEvalOutput`.

Images (`--multimodal-keys`): `GenerateState.processor` is the checkpoint's processor, and
`generate` sends a sample's `multimodal_inputs["images"]` as `image_data` with token ids that hold
each image's tokens (it sets `multimodal_train_inputs` when it tokenizes the prompt itself).
Traced as slime traces them (slime.observability.trace_utils): `generate_and_rm_group` (with
`group_size`) around `generate_and_rm` around `sglang_generate` (ending with the answer's meta_info)
and `reward_model`, or `group_reward_model` with `--group-rm`.
Not here: SGLang's data-parallel attention routing (`dp_rank_context` only counts).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

from slime.observability.trace_utils import build_sglang_meta_trace_attrs, trace_function, trace_span
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.utils.misc import SingletonMeta, load_function
from slime.utils.sample import Sample

__all__ = [
    "DEFAULT_ROLLOUT_FUNCTION",
    "GenerateState",
    "abort",
    "generate",
    "generate_and_rm",
    "generate_and_rm_group",
    "generate_rollout",
    "get_model_url",
]

DEFAULT_ROLLOUT_FUNCTION = "slime.rollout.sglang_rollout.generate_rollout"


def get_model_url(args: Any, model_name: str = "", endpoint: str = "/generate") -> str:
    """The router's address for `endpoint` (one model per job here: `model_name` is not used)."""
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


def default_sampling_params(args: Any) -> dict[str, Any]:
    """The sampling parameters of a rollout request: the built-in rollout's, with the keys slime's
    requests add."""
    from slime.config.arguments import sampling_config

    return {
        **sampling_config(args).params(),
        "skip_special_tokens": bool(getattr(args, "rollout_skip_special_tokens", False)),
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }


class GenerateState(metaclass=SingletonMeta):
    """What the default rollout shares between its requests (one per process)."""

    def __init__(self, args: Any) -> None:
        from transformers import AutoTokenizer

        from slime.config.arguments import cluster_config

        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        from slime.utils.processing_utils import load_processor

        self.processor = (
            load_processor(args.hf_checkpoint) if getattr(args, "multimodal_keys", None) else None
        )
        self.semaphore = asyncio.Semaphore(
            int(args.sglang_server_concurrency) * max(1, cluster_config(args).num_engines)
        )
        self.sampling_params = default_sampling_params(args)
        if getattr(args, "sglang_enable_deterministic_inference", False):
            self.group_sampling_seeds = [args.rollout_seed + i for i in range(args.n_samples_per_prompt)]
        self.dp_counts = [0] * max(1, int(getattr(args, "sglang_dp_size", None) or 1))
        self.dp_rank = 0
        self.reset()

    def reset(self) -> None:
        """Forget the last rollout's requests (called when a rollout ends)."""
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task[Any]] = set()
        self.aborted = False

    @contextlib.contextmanager
    def dp_rank_context(self) -> Iterator[int]:
        """The least-loaded data-parallel rank for one request (counted; not sent anywhere)."""
        rank = min(range(len(self.dp_counts)), key=self.dp_counts.__getitem__)
        self.dp_counts[rank] += 1
        self.dp_rank = rank
        try:
            yield rank
        finally:
            self.dp_counts[rank] -= 1

    def submit_generate_tasks(self, groups: list[list[Sample]]) -> None:
        """Start one task per group (generate and score); they join `pendings`."""
        for group in groups:
            task = asyncio.ensure_future(generate_and_rm_group(self.args, group, dict(self.sampling_params)))
            self.pendings.add(task)
        self.remaining_batch_size += len(groups)


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """One /generate call for `sample` through the router; continues a sample that already has
    response tokens (an aborted one) within the same max_new_tokens budget."""
    from slime.utils.http_utils import post

    state = GenerateState(args)
    if sample.status not in (Sample.Status.PENDING, Sample.Status.ABORTED):
        raise ValueError(
            f"generate: sample {sample.index} is {sample.status.value}; only pending or aborted "
            "samples are generated"
        )
    images = (sample.multimodal_inputs or {}).get("images") or []
    if images and not sample.tokens:
        if state.processor is None or not isinstance(sample.prompt, str):
            raise ValueError(
                f"generate: sample {sample.index} has images: it needs --multimodal-keys and a text "
                "prompt with the chat template applied (or set sample.tokens)"
            )
        from slime.utils.processing_utils import expanded_prompt_ids, image_train_inputs

        sample.tokens = expanded_prompt_ids(state.processor, sample.prompt, images)
        if sample.multimodal_train_inputs is None:
            sample.multimodal_train_inputs = image_train_inputs(state.processor, images)
    if not sample.tokens:
        if not isinstance(sample.prompt, str):
            raise ValueError(
                f"generate: sample {sample.index} has no token ids and its prompt is a list of chat messages "
                "(add --apply-chat-template, or set sample.tokens)"
            )
        sample.tokens = state.tokenizer.encode(sample.prompt, add_special_tokens=False)
    params = dict(sampling_params)
    params["max_new_tokens"] = params["max_new_tokens"] - sample.response_length
    if params["max_new_tokens"] < 0:
        raise ValueError(
            f"generate: sample {sample.index} already has {sample.response_length} response tokens, more "
            f"than max_new_tokens {sampling_params['max_new_tokens']}"
        )
    if params["max_new_tokens"] == 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    payload: dict[str, Any] = {
        "input_ids": list(sample.tokens),
        "sampling_params": params,
        "return_logprob": True,
    }
    if images:
        from slime.utils.processing_utils import encode_image_for_rollout_engine

        payload["image_data"] = [encode_image_for_rollout_engine(image) for image in images]
    if getattr(args, "use_rollout_routing_replay", False):
        payload["return_routed_experts"] = True
    from slime.rollout.default_generate import lora_path

    adapter = lora_path(args)
    if adapter is not None:  # --lora-push adapter: the engines serve the policy as an adapter
        payload["lora_path"] = adapter
    with trace_span(sample, "sglang_generate", attrs={"max_new_tokens": params["max_new_tokens"]}) as span:
        output = await post(get_model_url(args), payload)
        span.update(build_sglang_meta_trace_attrs(output["meta_info"]))
    meta = output["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    sample.append_response_tokens(
        args,
        tokens=[item[1] for item in pairs],
        log_probs=[item[0] for item in pairs],
        meta_info=meta,
        text=output.get("text", ""),
    )
    return sample


async def _custom_or_default(args: Any, sample: Sample, params: dict[str, Any], evaluation: bool) -> Any:
    path = sample.generate_function_path or getattr(args, "custom_generate_function_path", None)
    if path is None:
        return await generate(args, sample, params)
    fn = load_function(path)
    kwargs = {"evaluation": evaluation} if "evaluation" in inspect.signature(fn).parameters else {}
    result = fn(args, sample, params, **kwargs)
    return await result if inspect.isawaitable(result) else result


@trace_function("generate_and_rm", target="sample")
async def generate_and_rm(
    args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> Sample | list[Sample]:
    """Generate `sample` (unless it is already finished) and score it, unless `--group-rm`
    scores whole groups or the generate function already set a reward."""
    from slime.rollout.rm_hub import async_rm, batched_async_rm

    partial = getattr(args, "partial_rollout", False) and getattr(
        args, "mask_offpolicy_in_partial_rollout", False
    )
    if partial and sample.response_length:  # tokens of older weights count in no loss
        sample.loss_mask = [0] * sample.response_length
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        return sample
    state = GenerateState(args)
    async with state.semaphore:
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        with state.dp_rank_context():
            result = await _custom_or_default(args, sample, sampling_params, evaluation)
    if getattr(args, "group_rm", False):
        return result
    if isinstance(result, list):
        todo = [s for s in result if s.reward is None]
        if todo and not any(s.status == Sample.Status.ABORTED for s in result):
            with trace_span(todo, "reward_model"):
                rewards = await batched_async_rm(args, todo)
            for s, reward in zip(todo, rewards):
                s.reward = reward
        return result
    if result.status != Sample.Status.ABORTED and result.reward is None:
        with trace_span(result, "reward_model"):
            result.reward = await async_rm(args, result)
    return result


@trace_function(
    "generate_and_rm_group",
    target="group",
    attrs_getter=lambda args, group, sampling_params, evaluation=False: {"group_size": len(group)},
)
async def generate_and_rm_group(
    args: Any, group: list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Any]:
    """A prompt group: each sample gets a session id, is generated and scored; with
    `--group-rm` the group is scored together."""
    from slime.rollout.rm_hub import batched_async_rm

    state = GenerateState(args)
    if state.aborted:
        return group
    for sample in group:
        if sample.session_id is None:
            sample.session_id = str(uuid.uuid4())
    params = []
    for k in range(len(group)):
        p = dict(sampling_params)
        if hasattr(state, "group_sampling_seeds"):
            p["sampling_seed"] = state.group_sampling_seeds[k % len(state.group_sampling_seeds)]
        params.append(p)
    out = list(
        await asyncio.gather(*(generate_and_rm(args, s, p, evaluation) for s, p in zip(group, params)))
    )
    if getattr(args, "group_rm", False) and not state.aborted:
        with trace_span(out, "group_reward_model"):
            rewards = await batched_async_rm(args, out)
        for s, reward in zip(out, rewards):
            cast(Sample, s).reward = reward
    return out


async def abort(args: Any, rollout_id: int) -> list[list[Sample]]:
    """Abort every request on the engines and wait for the pending groups. With
    `--partial-rollout` they are returned (each sample with a response is marked with the
    rollout it started in, `metadata["start_rollout_id"]`), to be continued later."""
    from slime.utils.http_utils import get, post

    state = GenerateState(args)
    state.aborted = True
    try:
        workers = await get(get_model_url(args, endpoint="/workers"))
    except Exception:  # an engine without a router in front of it (torch engines) has no /workers
        workers = {}
    listed = workers.get("workers") if isinstance(workers, dict) else None
    urls = [w["url"] if isinstance(w, dict) else str(w) for w in listed or []] or [
        get_model_url(args, endpoint="")
    ]
    await asyncio.gather(*(post(f"{u}/abort_request", {"abort_all": True}, max_retries=3) for u in urls))
    kept: list[list[Sample]] = []
    while state.pendings:
        done, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
        if not getattr(args, "partial_rollout", False):
            continue
        for task in done:
            group = task.result()
            for s in group:
                if s.response and "start_rollout_id" not in s.metadata:
                    s.metadata["start_rollout_id"] = rollout_id
            kept.append(group)
    return kept


def generate_rollout(
    args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """slime's default rollout function: the built-in rollout for `rollout_id` (training) or the
    evaluation sets. `data_source` must be the one the rollout manager passed to the calling
    rollout function: it knows how to run the built-in rollout."""
    default: Callable[[int, bool], Any] | None = getattr(data_source, "default_rollout", None)
    if default is None:
        raise TypeError(
            "slime.rollout.sglang_rollout.generate_rollout runs the built-in rollout: call it with the "
            "data_source your --rollout-function-path function was given"
        )
    return default(rollout_id, evaluation)
