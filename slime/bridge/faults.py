"""`--debug-push-fault SPEC`: break a weight push on purpose, to see what the checks report.

The checks of docs/debugging.md (--check-precision, and the parameter-sync checks) are only
worth trusting once they have been seen to fail. A fault rewrites the stream of (HF name,
tensor) buckets on trainer rank 0 before any transport sees it, so it is the same fault for
every transport:

    perturb:NAME        add 1.0 to the first element of NAME
    noise:NAME          add Gaussian noise with NAME's own standard deviation to all of it
    transpose:NAME      send NAME transposed (a square matrix keeps its shape)
    drop:NAME           leave NAME out of the push
    swap:NAME1,NAME2    send each under the other's name (a wrong name mapping)

The model's own parameters are never modified: faulty tensors are copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slime.config.debug import parse_push_fault
from slime.utils.buckets import iter_buckets

if TYPE_CHECKING:  # the driver imports this module (PushFault.parse), and never needs torch itself
    import torch

Bucket = list[tuple[str, "torch.Tensor"]]


@dataclass(frozen=True)
class PushFault:
    kind: str
    names: tuple[str, ...]

    @staticmethod
    def parse(spec: str) -> PushFault:
        """`KIND:NAME` or `swap:NAME1,NAME2` (slime.config.debug.parse_push_fault: the flag's
        grammar); ValueError names the flag and the forms."""
        return PushFault(*parse_push_fault(spec))

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Before the first push, on every rank: the names exist and the fault fits their
        shapes (a fault that failed halfway through a push would leave ranks in a collective)."""
        missing = [n for n in self.names if n not in shapes]
        if missing:
            raise ValueError(
                f"--debug-push-fault: the model has no parameter named {missing[0]!r}; "
                f"some that exist: {', '.join(list(shapes)[:4])}"
            )
        first = shapes[self.names[0]]
        if self.kind == "transpose" and len(first) != 2:
            raise ValueError(f"--debug-push-fault transpose:{self.names[0]}: not a matrix ({first})")
        if self.kind == "swap" and first != shapes[self.names[1]]:
            raise ValueError(
                f"--debug-push-fault swap:{','.join(self.names)}: shapes {first} and "
                f"{shapes[self.names[1]]} differ (the engine would refuse the push before any check "
                "ran); pick two of the same shape"
            )

    def apply(self, buckets: Iterable[Bucket], bucket_bytes: int) -> Iterator[Bucket]:
        """The buckets with the fault applied. A swap holds the whole push in memory (the two
        tensors may sit in different buckets); the other kinds stream."""
        if self.kind == "swap":
            yield from self._swap(buckets, bucket_bytes)
            return
        seen = False
        for bucket in buckets:
            out: Bucket = []
            for name, tensor in bucket:
                if name != self.names[0]:
                    out.append((name, tensor))
                    continue
                seen = True
                if self.kind != "drop":
                    out.append((name, self._change(tensor)))
            if out:
                yield out
        if not seen:
            raise ValueError(f"--debug-push-fault: the push has no parameter named {self.names[0]!r}")

    def _change(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.kind == "transpose":
            return tensor.t().contiguous()
        changed = tensor.detach().clone()
        flat = changed.view(-1)
        if self.kind == "perturb":
            flat[0] += 1.0
        else:  # noise
            import torch

            generator = torch.Generator().manual_seed(0)
            std = float(tensor.float().std()) if tensor.numel() > 1 else 1.0
            noise = torch.randn(flat.shape, generator=generator) * (std or 1.0)
            flat += noise.to(flat.dtype)
        return changed

    def _swap(self, buckets: Iterable[Bucket], bucket_bytes: int) -> Iterator[Bucket]:
        everything = [(n, t.detach().clone()) for bucket in buckets for n, t in bucket]
        position = {n: i for i, (n, _) in enumerate(everything)}
        a, b = self.names
        for name in (a, b):
            if name not in position:
                raise ValueError(f"--debug-push-fault: the push has no parameter named {name!r}")
        ta, tb = everything[position[a]][1], everything[position[b]][1]
        everything[position[a]], everything[position[b]] = (a, tb), (b, ta)
        yield from iter_buckets(iter(everything), bucket_bytes)
