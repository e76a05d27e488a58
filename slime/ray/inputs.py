"""The user's inputs, read and checked in the driver before Ray starts: a bad one is one line
and exit code 2 (slime.utils.errors.UsageError), not a traceback from inside an actor."""

from __future__ import annotations

from slime.config.arguments import Config

FUNCTION_FLAGS = {
    "custom_rm_path": "--custom-rm-path",
    "rollout_function_path": "--rollout-function-path",
    "custom_generate_function_path": "--custom-generate-function-path",
    "dynamic_sampling_filter_path": "--dynamic-sampling-filter-path",
}


def check_inputs(config: Config) -> None:
    """The checkpoints the job loads, the prompt and eval data, the functions it imports, the
    sglang-router it is told to use."""
    from slime.backends.fsdp.model_init import check_hf_checkpoint
    from slime.rollout.data import check_prompt_file, eval_data_config
    from slime.rollout.rewards import load_function

    t, r = config.train, config.rollout
    check_hf_checkpoint(t.hf_checkpoint)
    if config.debug.phase_hook:
        load_function(config.debug.phase_hook, "--debug-phase-hook")
    if t.ref_load and t.loss.needs_ref and not config.debug.rollout_only:
        check_hf_checkpoint(t.ref_load, "--ref-load")
    c = config.cluster
    if c.router_ip is not None and c.router_port is not None and not config.debug.train_only:
        import contextlib

        from slime.engines.router import Router, RouterError

        # Nothing answers: a usage error naming the address. A RouterError means it answers
        # (perhaps not to a request without the job's key): the rollout manager's concern.
        with contextlib.suppress(RouterError):
            Router.running(c.router_ip, c.router_port)
    if config.debug.load_rollout_data is not None and config.debug.train_only:
        return  # replayed: the dumps are checked by the replay source; nothing generates
    if r.data is not None:
        check_prompt_file(r.data)
    if config.eval.prompt_data:
        check_prompt_file(eval_data_config(r.data, config.eval.prompt_data), "--eval-prompt-data")
    for field, flag in FUNCTION_FLAGS.items():
        path = getattr(r, field)
        if path:
            load_function(path, flag)
