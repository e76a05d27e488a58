"""`--check-weight-sync`: after every push, the engines must hold exactly what the trainer has.

The trainer fingerprints (slime.utils.checksum.tensor_fingerprint) every HF-named tensor as it
leaves `export_weights`, before anything downstream (name mapping, resharding, a
`--debug-push-fault`, the transport) can change it; it does so while the engine copies the
previous bucket, so it costs little. After the push every engine fingerprints what it holds
(`/slime/weights_fingerprint`) and the two lists are compared name by name:

    differs       same name, other bits (a perturbed, transposed or swapped tensor)
    shape/dtype   the engine's tensor has another shape or dtype
    not pushed    the engine holds a parameter the push never sent (a dropped tensor)
    not held      the trainer sent a name the engine does not have

Any line stops the job (WeightSyncError) with the names.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from slime.bridge.base import Bucket
from slime.utils.checksum import tensor_fingerprint


class WeightSyncError(RuntimeError):
    """The engines do not hold what the trainer pushed; the message names the tensors."""


class Fingerprints:
    """What the trainer exported in one push: name -> {dtype, shape, fingerprint}."""

    def __init__(self, engine_dtype: torch.dtype | None = None):
        self.engine_dtype = engine_dtype
        self.entries: dict[str, dict[str, Any]] = {}
        self.sent: set[str] = set()
        self.seconds = 0.0

    def record_sent(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        """Pass the buckets through, noting the names that actually reach the transport."""
        for bucket in buckets:
            self.sent.update(name for name, _ in bucket)
            yield bucket

    def record(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        """Pass the buckets through; fingerprint each one once the consumer asks for the next
        (after the transport sent it, while the engine copies it)."""
        for bucket in buckets:
            yield bucket
            start = time.perf_counter()
            for name, tensor in bucket:
                if self.engine_dtype is not None and tensor.dtype != self.engine_dtype:
                    tensor = tensor.to(self.engine_dtype)  # what the engine will hold
                self.entries[name] = {"dtype": str(tensor.dtype).removeprefix("torch."),
                                      "shape": list(tensor.shape), "fingerprint": tensor_fingerprint(tensor)}  # fmt: skip
            self.seconds += time.perf_counter() - start


def compare(
    expected: dict[str, dict[str, Any]], held: dict[str, dict[str, Any]], sent: set[str] | None = None
) -> list[str]:
    """One line per tensor where the engine (`held`) disagrees with the trainer (`expected`, the
    exported tensors; `sent`, the names that reached the transport, default all of them)."""
    sent = set(expected) if sent is None else sent
    lines = []
    for name in sorted(expected.keys() | held.keys() | sent):
        want, have = expected.get(name), held.get(name)
        if have is None:
            lines.append(f"not held: {name} (the push sent it; the engine has no parameter of this name)")
        elif want is None or name not in sent:
            lines.append(f"not pushed: {name} (the engine holds it, the push never sent it)")
        elif (want["dtype"], list(want["shape"])) != (have["dtype"], list(have["shape"])):
            lines.append(f"shape/dtype: {name} sent {want['dtype']}{list(want['shape'])}, engine holds "
                         f"{have['dtype']}{list(have['shape'])}")  # fmt: skip
        elif list(want["fingerprint"]) != list(have["fingerprint"]):
            lines.append(
                f"differs: {name} (fingerprint {want['fingerprint']} sent, {have['fingerprint']} held)"
            )
    return lines


def report(version: str, url: str, lines: list[str], limit: int = 20) -> str:
    more = f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else ""
    return (
        f"--check-weight-sync: after the weight push of version {version}, engine {url} disagrees with the "
        f"trainer on {len(lines)} tensor(s):\n  " + "\n  ".join(lines[:limit]) + more +
        '\nSee docs/debugging.md "Parameter sync" (dump both sides with --debug-sync-parameters-path).'
    )  # fmt: skip
