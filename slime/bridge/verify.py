"""`--check-weight-sync`: after every push, the engines must hold exactly what the trainer has.

The trainer fingerprints (slime.utils.checksum.tensor_fingerprint) every HF-named tensor as it
leaves `export_weights`, before anything downstream (name mapping, resharding, a
`--debug-push-fault`, the transport) can change it, on a worker thread while the push goes on.
Each engine fingerprints every parameter right after copying it in, while it is still in cache,
and returns them with its answer to the update (`slime_fingerprints`, a torch-engine
extension), so the check costs no extra request. The lists are compared name by name:

    differs       same name, other bits (a perturbed, transposed or swapped tensor)
    shape/dtype   the engine's tensor has another shape or dtype
    not pushed    the engine holds a parameter the push never wrote (a dropped tensor)
    not held      the trainer has a tensor the engine has no parameter for
    unexpected    the engine was sent a name the trainer never exported

Any line stops the job (WeightSyncError) with the names.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from slime.bridge.base import Bucket
from slime.utils.checksum import fingerprint_entry


class WeightSyncError(RuntimeError):
    """The engines do not hold what the trainer pushed; the message names the tensors."""


class Fingerprints:
    """What the trainer exported in one push: name -> {dtype, shape, fingerprint}."""

    def __init__(self, engine_dtype: torch.dtype | None = None):
        self.engine_dtype = engine_dtype
        self.entries: dict[str, dict[str, Any]] = {}
        self.sent: set[str] = set()
        self.seconds = 0.0
        self._futures: list[Any] = []

    def record_sent(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        """Pass the buckets through, noting the names that actually reach the transport."""
        for bucket in buckets:
            self.sent.update(name for name, _ in bucket)
            yield bucket

    def record(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        """Pass the buckets through; each one is fingerprinted on a worker thread once the
        consumer asks for the next (after the transport took it, while the engine copies it).
        torch releases the GIL, so the push goes on meanwhile; `wait()` collects the results."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1, thread_name_prefix="slime-fingerprint") as pool:
            for bucket in buckets:
                yield bucket
                self._futures.append(pool.submit(self._fingerprint, bucket))

    def _fingerprint(self, bucket: Bucket) -> None:
        start = time.perf_counter()
        for name, tensor in bucket:
            if self.engine_dtype is not None and tensor.dtype != self.engine_dtype:
                tensor = tensor.to(self.engine_dtype)  # what the engine will hold
            self.entries[name] = fingerprint_entry(tensor)
        self.seconds += time.perf_counter() - start

    def wait(self) -> dict[str, dict[str, Any]]:
        """Every exported tensor's entry (raises what a fingerprint raised)."""
        for future in self._futures:
            future.result()
        return self.entries


def compare(
    expected: dict[str, dict[str, Any]], written: dict[str, dict[str, Any]], held: list[str], sent: set[str]
) -> list[str]:
    """One line per tensor where an engine disagrees with the trainer. `expected`: the trainer's
    exported tensors; `written`: what the engine wrote in this push; `held`: every parameter
    name the engine has; `sent`: the names that reached the transport."""
    lines = []
    for name in sorted(expected.keys() | set(held) | sent):
        want, got = expected.get(name), written.get(name)
        if name not in held:
            lines.append(f"not held: {name} (the trainer has it; the engine has no parameter of this name)")
        elif got is None:
            lines.append(f"not pushed: {name} (the engine holds it, the push never wrote it)")
        elif want is None:
            lines.append(f"unexpected: {name} (the engine was sent it, the trainer exported no such tensor)")
        elif (want["dtype"], list(want["shape"])) != (got["dtype"], list(got["shape"])):
            lines.append(
                f"shape/dtype: {name} exported {want['dtype']}{list(want['shape'])}, engine holds "
                f"{got['dtype']}{list(got['shape'])}"
            )
        elif list(want["fingerprint"]) != list(got["fingerprint"]):
            lines.append(
                f"differs: {name} (fingerprint {want['fingerprint']} exported, {got['fingerprint']} held)"
            )
    return lines


def report(version: str, url: str, lines: list[str], limit: int = 20) -> str:
    more = f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else ""
    return (
        f"--check-weight-sync: after the weight push of version {version}, engine {url} disagrees with the "
        f"trainer on {len(lines)} tensor(s):\n  "
        + "\n  ".join(lines[:limit])
        + more
        + '\nSee docs/debugging.md "Parameter sync" (dump both sides with --debug-sync-parameters-path).'
    )
