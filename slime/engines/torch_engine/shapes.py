"""Decode shapes that repeat: batch rows and key lengths rounded up into buckets (plain Python).

On CUDA every new tensor shape can cost far more than the step itself: cuDNN builds (runtime-
compiles) an attention plan per shape, and a CUDA graph is captured per shape. A decode loop's
key length grows by one every step and its batch shrinks as requests finish, so exact shapes are
new almost every step. Rounded up into buckets, a whole generation run visits a few dozen shapes.

Buckets are the powers of two up to `floor`, then four per octave (x, 1.25x, 1.5x, 1.75x of a
power of two): at most ~25% padding, about 4 x log2(limit / floor) buckets. Padded batch rows and
padded keys are masked (see BatchedRunner), so they change no real row's result beyond the
kernels' own rounding.
"""

from __future__ import annotations

from dataclasses import dataclass


def bucket(n: int, floor: int = 8, limit: int | None = None) -> int:
    """The smallest bucket >= n (capped at `limit`, never below n)."""
    if n <= 0:
        raise ValueError(f"bucket of {n}: need a positive size")
    if n <= floor:
        size = 1 << (n - 1).bit_length()
    else:
        octave = 1 << (n.bit_length() - 1)  # the power of two <= n
        step = max(octave // 4, 1)
        size = -(-n // step) * step  # round up to a quarter of the octave
    if limit is not None:
        size = min(size, limit)
    return max(size, n)


@dataclass(frozen=True)
class DecodeShapes:
    """How a decode step's batch and key length are shaped: exact (`bucketed=False`, the CPU
    default: padding would cost real compute there) or rounded up into buckets (CUDA)."""

    bucketed: bool
    max_rows: int
    max_len: int
    key_floor: int = 128
    """Key lengths up to this many share power-of-two buckets from 1 up."""

    def rows(self, n: int) -> int:
        return bucket(n, 8, self.max_rows) if self.bucketed else n

    def keys(self, n: int) -> int:
        return bucket(n, self.key_floor, self.max_len) if self.bucketed else n
