"""`--lora-push adapter`: the policy's LoRA adapter alone into the engines, by SGLang's routes.

One push, for either engine:

    pause generation → load the adapter from tensors as `slime_lora` → set the weight version
    → continue generation

The tensors travel as SGLang's `flattened_bucket` payload (slime.bridge.ipc), one per engine
tensor-parallel rank (`serialized_named_tensors[tp_rank]`), by the push topology's kind:

    shared_memory   (CPU) train rank 0 copies the adapter into one shared-memory file, reused push
                    after push; every engine opens that one payload.
    ipc             (colocated: CUDA IPC on GPU, shared memory on CPU) every train rank shares its
                    own copy (share_buckets); engine j's TP rank k opens the copy of the train
                    rank on its GPU, as in the whole-weight IPC push.
    distributed, disk are refused at start-up (slime.config.lora): SGLang has no route that takes
                    an adapter through a process group.

Replacing the loaded version: the torch engine replaces it in place (`upsert`, also Miles's SGLang
field), so requests paused with it go on with the new one. Upstream SGLang has no such field (it
ignores unknown fields): the push unloads the adapter first, which waits for the requests using
it, so the SGLang adapter push runs only where none is in flight at a push (train.py; refused
with the asynchronous schedules, slime.ray.driver).

`checksums` (--check-weight-sync, --check-weight-update-equal, --check-precision): the load
carries SGLang's `expected_checksums`, the sha256 of each tensor's bytes; the engine checks what it
received and refuses the adapter on a mismatch (the torch engine answers 400, which stops the job
with WeightSyncError; SGLang raises in its scheduler).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from slime.engines.client import EngineClient, EngineError
from slime.utils.async_utils import run_sync

if TYPE_CHECKING:
    import torch

    from slime.bridge.bridge import PushStats, WeightBridge
    from slime.bridge.topology import PushTopology

logger = logging.getLogger(__name__)


class AdapterSource(Protocol):
    """A train rank that holds a LoRA adapter (slime.backends.policy.PolicyTrainer)."""

    def export_adapter(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        """The adapter whole under PEFT's names, and its PEFT config (every rank takes part)."""
        ...


def push_actor_adapter(
    actor: AdapterSource,
    bridge: WeightBridge | None,
    weight_version: str,
    topology: PushTopology | None,
    checksums: bool,
) -> PushStats | None:
    """Every train rank: the adapter gathered whole (every rank takes part); rank 0, the one
    holding the bridge, sends it. Returns the push statistics on rank 0, None elsewhere."""
    named, config = actor.export_adapter()
    if topology is None or not topology.every_rank_shares:
        if bridge is None:
            return None
        return run_sync(push_adapter(bridge, named, config, weight_version, None, checksums))
    from slime.bridge.ipc import IpcTransport, share_buckets

    holder = IpcTransport(topology.tp_sizes) if bridge is not None else None  # rank 0: every rank's payload
    stats: PushStats | None = None
    failure: BaseException | None = None
    for _ in share_buckets([named], holder, topology.sglang):
        if bridge is not None and holder is not None:
            try:
                stats = run_sync(
                    push_adapter(bridge, named, config, weight_version, holder.payloads, checksums)
                )
            except BaseException as e:  # reach the ranks' barrier first: they wait there for rank 0
                failure = e
    if failure is not None:
        raise failure
    return stats


async def push_adapter(
    bridge: WeightBridge,
    named: list[tuple[str, torch.Tensor]],
    config: dict[str, Any],
    weight_version: str,
    payloads: list[str] | None = None,
    checksums: bool = False,
    name: str | None = None,
) -> PushStats:
    """--lora-push adapter: the policy's LoRA adapter alone into every
    engine. `payloads`: every train rank's shared copy (the IPC topology); None: this rank
    copies the adapter into its shared-memory file, one payload for every engine."""
    from slime.config.lora import ADAPTER_NAME

    if bridge.sglang and config.get("target_parameters"):
        from slime.utils.errors import UsageError

        raise UsageError(
            f"--lora-push adapter to SGLang engines: the adapter adapts parameters "
            f"({', '.join(sorted(config['target_parameters']))}: a mixture-of-experts model's fused experts "
            "or router) in PEFT's target_parameters layout, which slime has not checked SGLang serves; use "
            "--lora-push merged, or the torch engine"
        )
    if payloads is None:
        from slime.utils.flattened_bucket import flat_size, flatten, serialize
        from slime.utils.shm_tensors import SharedBuffer

        need = max(flat_size(named), 1)
        if bridge.adapter_buffer is None or bridge.adapter_buffer.nbytes < need:
            if bridge.adapter_buffer is not None:
                bridge.adapter_buffer.close()
            bridge.adapter_buffer = SharedBuffer.create(need)  # reused push after push
        flat, metadata = flatten(named, bridge.adapter_buffer.data)
        one = serialize(flat, metadata, False, bridge.adapter_buffer.path)
        per_engine = [[one] * tp for tp in bridge.tp_sizes]
    else:
        from slime.bridge.ipc import split_by_engine

        per_engine = split_by_engine(payloads, bridge.tp_sizes, "the adapter")
    return await push(bridge, named, config, weight_version, per_engine, checksums, name or ADAPTER_NAME)


async def load_into(
    engine: EngineClient,
    name: str,
    config: dict[str, Any],
    payloads: list[str],
    sglang: bool,
    expected: dict[str, str] | None,
    weight_version: str,
) -> None:
    """The adapter's new version into one engine, in place of the old (loaded fresh the first
    time). SGLang: unloaded first (a 400 means none was loaded: the first push, or an engine that
    restarted)."""
    from slime.utils.flattened_bucket import LOAD_FORMAT

    if sglang:
        try:
            await engine.unload_lora_adapter(name)
        except EngineError as e:
            if e.status != 400:
                raise
    try:
        await engine.load_lora_adapter_from_tensors(
            name, config, payloads, load_format=LOAD_FORMAT, expected_checksums=expected, upsert=not sglang
        )
    except EngineError as e:
        if expected is not None and e.status == 400 and "MISMATCH" in e.message:
            from slime.bridge.verify import WeightSyncError

            raise WeightSyncError(
                f"--check-weight-sync: the LoRA adapter push of version {weight_version}: engine "
                f"{engine.base_url} did not receive the trainer's tensors: {e.message}"
            ) from None
        raise


async def push(
    bridge: WeightBridge,
    named: list[tuple[str, torch.Tensor]],
    config: dict[str, Any],
    weight_version: str,
    per_engine: list[list[str]],
    checksums: bool,
    name: str,
) -> PushStats:
    """Rank 0: pause, load into every engine, set the version, continue."""
    from slime.utils.checksum import bytes_sha256

    expected = {n: bytes_sha256(t) for n, t in named} if checksums else None
    engines = [bridge.make_client(u) for u in bridge.engine_urls]
    start = time.perf_counter()
    try:
        await asyncio.gather(*(e.pause_generation(bridge.pause_mode) for e in engines))
        try:
            await asyncio.gather(
                *(
                    load_into(e, name, config, p, bridge.sglang, expected, weight_version)
                    for e, p in zip(engines, per_engine, strict=True)
                )
            )
            await asyncio.gather(*(e.update_weight_version(weight_version) for e in engines))
        finally:
            await asyncio.gather(*(e.continue_generation() for e in engines))
    finally:
        await asyncio.gather(*(e.close() for e in engines))
    total = sum(t.numel() * t.element_size() for _, t in named)
    seconds = time.perf_counter() - start
    checked = f", {len(named)} sha256 checked by every engine" if checksums else ""
    logger.info(
        "pushed the LoRA adapter %r, %.2f MB in %d tensors, weight_version %s in %.3f s%s",
        name,
        total / 1e6,
        len(named),
        weight_version,
        seconds,
        checked,
    )
    return {
        "bytes": float(total),
        "seconds": seconds,
        "buckets": 1.0,
        "transport": f"lora_adapter_{bridge.label}",
    }
