"""What the loop runs besides the training step: attaching external engines, and the
start-up and per-rollout checks of docs/debugging.md (parameter-sync dumps, snapshot/compare,
the precision gates). Each takes the Job and the config and raises an error naming what failed."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import ray

from slime.config.arguments import Config

if TYPE_CHECKING:
    from slime.ray.job import Job
    from slime.ray.loop import Replay

logger = logging.getLogger(__name__)


class ExternalEngineError(RuntimeError):
    """An engine named by --rollout-external-engine-addrs cannot be used (a usage error, exit 2)."""


def attach_external(urls: list[str], timeout_s: float) -> None:
    """Check that every external engine answers /health and /get_server_info; log what it serves."""
    import asyncio

    from slime.engines.client import ClientConfig, EngineClient, EngineError
    from slime.utils.aio import run_sync

    async def probe(url: str) -> dict[str, Any]:
        async with EngineClient(url, ClientConfig(timeout_s=min(timeout_s, 30.0), max_retries=1)) as c:
            try:
                if not await c.health():
                    raise EngineError("GET /health did not answer 200", url=url)
                return await c.get_server_info()
            except EngineError as e:
                raise ExternalEngineError(
                    f"--rollout-external-engine-addrs: {url} cannot be used ({e.message}); start that engine "
                    "first or fix the address"
                ) from None

    async def probe_all() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(probe(u) for u in urls)))

    for url, info in zip(urls, run_sync(probe_all())):
        logger.info("attached external engine %s: model_path %s, weight_version %s, tp_size %s",
                    url, info.get("model_path"), info.get("weight_version"), info.get("tp_size"))  # fmt: skip


def sync_parameters_dump(job: Job, root: str, version: int) -> None:
    """--debug-sync-parameters-path: the engines' parameters before and after one push."""
    before, after = os.path.join(root, "before_sync_parameter"), os.path.join(root, "after_sync_parameter")
    counts = ray.get(job.manager.dump_parameters.remote(before))
    job.push(version)
    ray.get(job.manager.dump_parameters.remote(after))
    logger.info(
        "--debug-sync-parameters-path: %d engine rank(s) dumped %s parameters to %s/ and %s/ (one torch.save file "
        "per HF parameter name); the trainer loaded the same checkpoint, so they must be equal. Check with:\n"
        "  python -m slime.tools.check_sync_parameter --root_dir %s",
        len(counts), "/".join(map(str, counts)), before, after, root,
    )  # fmt: skip


def check_weight_update_equal(job: Job, version: int, resumed: bool) -> None:
    """--check-weight-update-equal: snapshot the engines' --hf-checkpoint weights, scramble them,
    push the trainer's, and require the snapshot back bit for bit (SGLang's /weights_checker)."""
    from slime.bridge.verify import WeightSyncError
    from slime.engines.client import EngineError

    if resumed:
        logger.warning(
            "--check-weight-update-equal: skipped, the resumed trainer's weights are not the checkpoint's"
        )
        job.push(version)
        return
    ray.get(job.manager.engines.remote("weights_checker", "snapshot"))
    ray.get(job.manager.engines.remote("weights_checker", "reset_tensors"))
    job.push(version)
    try:
        ray.get(job.manager.engines.remote("weights_checker", "compare"))
    except ray.exceptions.RayTaskError as e:
        cause = e.cause
        if not isinstance(cause, EngineError):
            raise
        raise WeightSyncError(
            "--check-weight-update-equal: after the first push an engine's weights differ from the checkpoint "
            f"it loaded ({cause.url}):\n{cause.message}\nEvery parameter was overwritten with noise before the "
            'push, so a parameter listed here was sent wrong or never sent. See docs/debugging.md "Parameter sync".'
        ) from None
    logger.info(
        "--check-weight-update-equal: after the first push every engine parameter equals the checkpoint"
    )


def check_precision(
    config: Config,
    replay: Replay | None,
    log_dir: str,
    rollout_id: int,
    first: bool,
    resumed: bool,
    output: Any,
) -> None:
    """--check-precision after a train call: raise PrecisionError (the report) on a failed gate;
    the first rollout's checks also go to <log dir>/precision.json and one log line."""
    import dataclasses
    import json

    from slime.debug import precision
    from slime.utils.files import atomic_write_text

    t, d = config.train, config.debug
    ctx = precision.Context(
        rollout_id=rollout_id,
        first=first,
        mean_tol=d.precision_logprob_tol,
        max_tol=d.precision_logprob_max_tol,
        dtype=d.precision_dtype,
        trainer_temperature=t.rollout_temperature,
        sample_temperature=replay.temperature if replay is not None else None,
        ref_load=t.ref_load if t.ref_load and t.ref_load != t.hf_checkpoint else None,
        separate_log_prob_batches=t.batch.use_dynamic_batch_size
        and t.batch.log_probs_max_tokens_per_gpu not in (None, t.batch.max_tokens_per_gpu),
        replay=replay is not None,
        resumed=resumed,
    )
    checks = precision.gates(ctx, output.rollout, output.precision, output.steps[0] if output.steps else {})
    if first:
        record = {"rollout_id": rollout_id, "checks": [dataclasses.asdict(c) for c in checks]}
        atomic_write_text(os.path.join(log_dir, "precision.json"), json.dumps(record, indent=1))
    if precision.failed(checks):
        raise precision.PrecisionError(precision.report(ctx, checks))
    if first:
        logger.info("%s", precision.summary(ctx, checks))
