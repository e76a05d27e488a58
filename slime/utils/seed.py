"""Seeding and deterministic kernels for one process (--deterministic-mode)."""

from __future__ import annotations

import os
import random


def enable_deterministic(seed: int) -> None:
    """Seed Python, NumPy and torch, and make torch refuse non-deterministic kernels.

    On CUDA, cuBLAS needs CUBLAS_WORKSPACE_CONFIG before its first use (set here when unset) and
    cuDNN must not autotune; an op with no deterministic implementation then raises instead of
    silently varying (torch.use_deterministic_algorithms).
    """
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional
        pass
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def sample_seed(*keys: int | str) -> int:
    """A 63-bit sampling seed for one sample, from the run's seed and what names the sample
    (kind, rollout id, draw order, index in its group): the same sample gets the same seed in every
    run, whichever engine serves it and in whatever order."""
    import hashlib

    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
