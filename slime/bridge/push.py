"""One push from a train actor: every rank exports its buckets, rank 0 (the one holding the
bridge) sends them (slime.bridge.bridge), with the --check-weight-sync fingerprints and the
--debug-push-fault fault on the way; a LoRA policy with --lora-push adapter sends its adapter
alone (slime.bridge.adapter)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from slime.bridge.adapter import AdapterSource, push_actor_adapter
from slime.bridge.bridge import PushStats, WeightBridge
from slime.bridge.faults import PushFault
from slime.bridge.topology import PushTopology
from slime.utils.async_utils import run_sync

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class WeightSource(AdapterSource, Protocol):
    """What a push reads from a train rank: the policy (slime.backends.policy.PolicyTrainer), or a
    test's stand-in."""

    @property
    def pushes_adapter(self) -> bool:
        """Whether the push sends the LoRA adapter alone (--lora-push adapter)."""
        ...

    def export_weights(
        self, bucket_bytes: int, every_rank: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """(HF name, full tensor) in buckets of at most `bucket_bytes`; every rank must iterate."""
        ...


def push_actor_weights(
    actor: WeightSource,
    bridge: WeightBridge | None,
    weight_version: str,
    bucket_bytes: int,
    fault: PushFault | None = None,
    verify: bool = False,
    topology: PushTopology | None = None,
) -> PushStats | None:
    """One push from a train actor: every rank gathers the buckets, rank 0 (the one holding the
    bridge) sends them, with `fault` (--debug-push-fault) applied. When `topology` says every rank
    shares (the CUDA-IPC push), every rank shares its own copy and rank 0 sends the handles; the
    ranks of one push must be given the same topology. With `verify` (--check-weight-sync) the
    engines are checked against fingerprints of the exported tensors (taken before the fault).
    Returns the push statistics on rank 0, None elsewhere."""
    if actor.pushes_adapter:
        return push_actor_adapter(actor, bridge, weight_version, topology, verify)
    ipc = topology is not None and topology.every_rank_shares
    if bridge is not None:
        from slime.bridge.ipc import IpcTransport

        if isinstance(bridge.transport, IpcTransport) != ipc:
            said = topology.label if topology is not None else "nothing"
            raise ValueError(
                f"the bridge's transport is {bridge.label} but the push topology says {said}: give "
                "every rank the topology the bridge was built from"
            )
    buckets = actor.export_weights(bucket_bytes, every_rank=ipc)
    if bridge is None and not ipc:
        for _ in buckets:
            pass
        return None
    prints = None
    if verify and bridge is not None:
        from slime.bridge.verify import Fingerprints

        prints = Fingerprints(bridge.engine_dtype_once())
        buckets = prints.record(buckets)
    if fault is not None and (bridge is not None or ipc):  # with ipc every rank sends its own copy
        buckets = fault.apply(buckets, bucket_bytes)
    if prints is not None:
        buckets = prints.record_sent(buckets)
    if ipc:  # slime.bridge.ipc: every rank shares its buckets, rank 0 sends all ranks' handles
        from slime.bridge.ipc import IpcTransport, share_buckets

        assert topology is not None
        transport = bridge.transport if bridge is not None else None
        assert transport is None or isinstance(transport, IpcTransport)
        buckets = share_buckets(buckets, transport, topology.sglang)
    if bridge is None:
        for _ in buckets:
            pass
        return None
    try:
        stats = run_sync(bridge.push(buckets, weight_version, collect=prints is not None))
    except BaseException:
        # The other ranks are still gathering the buckets with this one: take the rest of them,
        # so that they finish the push (and hear of the failure from the driver) instead of
        # waiting in a collective until the timeout.
        for _ in buckets:
            pass
        raise
    if prints is not None:
        start = time.perf_counter()
        bridge.verify(prints.wait(), weight_version, prints.sent)
        stats.update(
            verify_trainer_seconds=prints.seconds, verify_compare_seconds=time.perf_counter() - start
        )
        logger.info(
            "--check-weight-sync: %d tensors match on every engine, weight version %s (trainer "
            "fingerprints %.4f s)",
            len(prints.entries),
            weight_version,
            prints.seconds,
        )
    return stats
