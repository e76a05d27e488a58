"""The user's inputs, read and checked in the driver before Ray starts: a bad one is one line
and exit code 2 (slime.utils.errors.UsageError), not a traceback from inside an actor."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

from slime.config.arguments import Config
from slime.engines.protocol import API_KEY_ENV
from slime.utils.errors import UsageError

FUNCTION_FLAGS = {
    "custom_rm_path": "--custom-rm-path",
    "rollout_function_path": "--rollout-function-path",
    "custom_generate_function_path": "--custom-generate-function-path",
    "dynamic_sampling_filter_path": "--dynamic-sampling-filter-path",
    "reward_post_process_path": "--custom-reward-post-process-path",
}


def check_inputs(config: Config) -> None:
    """The checkpoints the job loads, the prompt and eval data, the functions it imports, the
    sglang-router it is told to use: the first problem is raised."""
    for check in _checks(config, weights=True, reach=True):
        try:
            check()
        except UsageError:
            raise
        except ValueError as e:  # a reward the flags cannot build
            raise UsageError(str(e)) from e


def input_problems(config: Config, weights: bool = True, reach: bool = True) -> list[str]:
    """Every problem with the inputs, one message each (--dry-run: `weights=False` does not ask for
    the weight files, `reach=False` contacts no router)."""
    out = []
    for check in _checks(config, weights, reach):
        try:
            check()
        except (UsageError, ValueError) as e:
            out.append(str(e))
    return out


def _check_engine_key() -> None:
    """SLIME_ENGINE_API_KEY, the key of the engines the job starts: one that fits a header."""
    from slime.engines.protocol import check_api_key

    key = os.environ[API_KEY_ENV]
    try:
        check_api_key(key)
    except ValueError as e:
        raise UsageError(f"{API_KEY_ENV} (the key of the engines the job starts): {e}") from e
    if key.startswith("-"):  # SGLang's command line would read it as an option
        raise UsageError(f"{API_KEY_ENV} (the key of the engines the job starts) must not begin with '-'")


def _check_trace_dir(path: str) -> None:
    from slime.observability.timeline import trace_dir_problem

    problem = trace_dir_problem(path)
    if problem is not None:
        raise UsageError(problem)


def _teacher_checks(config: Config, weights: bool) -> Iterator[Callable[[], object]]:
    """--opd-teacher-load: the student's architecture (in the train ranks), or its tokenizer (an
    engine), where the mode uses the teacher (a train-only replay takes the dumps' log-probs)."""
    from slime.backends.hf_checkpoint import check_hf_checkpoint, check_same_architecture
    from slime.config.opd import OTHER_ARCHITECTURE
    from slime.rollout.teacher import check_same_tokenizer

    opd, t, d = config.opd, config.train, config.debug
    teacher = opd.teacher_load
    if teacher is None or (d.rollout_only if opd.in_train else d.train_only):
        return
    if opd.in_train:
        student = functools.partial(check_hf_checkpoint, t.hf_checkpoint, weights=False)
        yield lambda: check_same_architecture(student(), teacher, "--opd-teacher-load", OTHER_ARCHITECTURE)
    else:
        yield functools.partial(check_hf_checkpoint, teacher, "--opd-teacher-load", weights=weights)
        yield functools.partial(check_same_tokenizer, t.hf_checkpoint, teacher)


def _checks(config: Config, weights: bool, reach: bool) -> Iterator[Callable[[], object]]:
    from slime.algo.plugins import REDUCER_FLAG, TIS_FLAG
    from slime.backends.hf_checkpoint import check_hf_checkpoint
    from slime.config.eval_sets import eval_flag
    from slime.rollout.rewards import RewardModel
    from slime.utils.misc import load_function

    t, r = config.train, config.rollout
    yield functools.partial(check_hf_checkpoint, t.hf_checkpoint, weights=weights)
    if config.debug.phase_hook:
        yield functools.partial(load_function, config.debug.phase_hook, "--debug-phase-hook")
    if config.debug.trace_dir is not None:
        yield functools.partial(_check_trace_dir, config.debug.trace_dir)
    if os.environ.get(API_KEY_ENV) and not config.cluster.external_engine_addrs:
        yield _check_engine_key
    if t.ref_load and t.loss.needs_ref and not config.debug.rollout_only:
        yield functools.partial(check_hf_checkpoint, t.ref_load, "--ref-load", weights=weights)
    yield from _teacher_checks(config, weights)
    critic = config.critic.train.hf_checkpoint if config.critic is not None else None
    if critic is not None and critic != t.hf_checkpoint:  # --critic-load
        yield functools.partial(check_hf_checkpoint, critic, "--critic-load", weights=weights)
    ip, port = config.cluster.router_ip, config.cluster.router_port
    if reach and ip is not None and port is not None and not config.debug.train_only:
        yield functools.partial(_router_answers, ip, port)
    if not config.debug.rollout_only:
        for path, flag in (
            (t.loss.custom_tis_function_path, TIS_FLAG),
            (t.loss.custom_pg_loss_reducer_function_path, REDUCER_FLAG),
        ):
            if path:
                yield functools.partial(load_function, path, flag)
    if config.debug.load_rollout_data is not None and config.debug.train_only:
        return  # replayed: the dumps are checked by the replay source; nothing generates
    if r.data is not None:
        yield functools.partial(_check_prompts, r.data, "--prompt-data", t.hf_checkpoint)
    for ds in config.eval.datasets:
        yield functools.partial(_check_prompts, ds.data, eval_flag(ds), t.hf_checkpoint)
        if ds.rm_type or ds.custom_rm_path:
            yield functools.partial(RewardModel, ds.rm_type, ds.custom_rm_path, False, config.args)
        if ds.custom_generate_function_path:
            where = f"{eval_flag(ds)} custom_generate_function_path"
            yield functools.partial(load_function, ds.custom_generate_function_path, where)
    for field, flag in FUNCTION_FLAGS.items():
        path = getattr(r, field)
        if path:
            yield functools.partial(load_function, path, flag)
    sample_filter = getattr(config.args, "rollout_sample_filter_path", None)
    if sample_filter:
        yield functools.partial(load_function, sample_filter, "--rollout-sample-filter-path")
    if r.rm_type and not r.custom_rm_path:
        yield functools.partial(RewardModel, r.rm_type, None, r.group_rm, config.args)


def _check_prompts(data: Any, flag: str, hf_checkpoint: str) -> None:
    """Every row of a prompt file; with --multimodal-keys every image too, by the checkpoint's
    own image processor."""
    from slime.rollout.data import check_prompt_file
    from slime.rollout.vision import checked_processor

    check_prompt_file(data, flag, checked_processor(hf_checkpoint) if data.multimodal_keys else None)


def _router_answers(ip: str, port: int) -> None:
    import contextlib

    from slime.engines.router import Router, RouterError

    # Nothing answers: a usage error naming the address. A RouterError means it answers
    # (perhaps not to a request without the job's key): the rollout manager's concern.
    with contextlib.suppress(RouterError):
        Router.running(ip, port)
