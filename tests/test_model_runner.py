"""Runner pieces that need no model: the slot KV cache."""

from __future__ import annotations

import pytest
import torch

from slime.engines.torch_engine import model_runner
from slime.engines.torch_engine.kv_cache import SlotKVCache


def _cache() -> SlotKVCache:
    return SlotKVCache(3, 2, 4, torch.float32, torch.device("cpu"), max_rows=64, max_len=1024)


def test_grow_keeps_contents():
    cache = _cache()
    cache.ensure(2, 5)
    cache.k[1][1, 0, 4] = 7.0
    cache.ensure(20, 300)
    assert (cache.rows, cache.length) == (32, 512)
    assert cache.k[1][1, 0, 4, 0].item() == 7.0 and len(cache.k) == len(cache.v) == 3


def test_failed_grow_leaves_the_cache_as_it_was(monkeypatch):
    cache = _cache()
    cache.ensure(2, 5)
    for buf in cache.k + cache.v:
        buf.normal_()
    before_k = [t.clone() for t in cache.k]
    before_v = [t.clone() for t in cache.v]
    sizes = (cache.rows, cache.length)

    real_zeros = torch.zeros
    calls = {"n": 0}

    def zeros_that_run_out(*args, **kwargs):
        # Fail half way through the new buffers, as an out-of-memory error would.
        calls["n"] += 1
        if calls["n"] == 4:
            raise torch.OutOfMemoryError("simulated out of memory")
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(model_runner.torch, "zeros", zeros_that_run_out)
    with pytest.raises(torch.OutOfMemoryError):
        cache.ensure(40, 700)
    monkeypatch.setattr(model_runner.torch, "zeros", real_zeros)

    assert (cache.rows, cache.length) == sizes
    assert all(t.shape == before_k[0].shape for t in cache.k + cache.v)
    assert all(torch.equal(a, b) for a, b in zip(cache.k, before_k))
    assert all(torch.equal(a, b) for a, b in zip(cache.v, before_v))
    cache.move_row(1, 0, 5)  # still usable with the old sizes
    cache.ensure(40, 700)
    assert (cache.rows, cache.length) == (64, 1024)
