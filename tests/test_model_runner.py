"""Runner pieces that need no model: the slot KV cache."""

from __future__ import annotations

import pytest
import torch

from slime.engines.torch_engine import model_runner
from slime.engines.torch_engine.kv_cache import SlotKVCache


def _cache() -> SlotKVCache:
    return SlotKVCache(3, 2, 4, torch.float32, torch.device("cpu"), max_rows=64, max_len=1024)


@pytest.mark.parametrize("token_major", [False, True], ids=["head-major", "token-major"])
def test_grow_keeps_contents(token_major):
    cache = SlotKVCache(3, 2, 4, torch.float32, torch.device("cpu"), 64, 1024, token_major=token_major)
    cache.ensure(2, 5)
    cache.write_decode(
        1, torch.tensor([1]), torch.tensor([4]), torch.full((1, 2, 1, 4), 7.0), torch.ones(1, 2, 1, 4)
    )
    cache.ensure(20, 300)
    assert (cache.rows, cache.length) == (32, 512)
    k, v = cache.view(1, slice(1, 2), 5)
    assert k[0, :, 4].eq(7.0).all() and v[0, :, 4].eq(1.0).all() and k[0, :, :4].eq(0).all()
    assert cache.k[1].shape == ((32, 512, 2, 4) if token_major else (32, 2, 512, 4))
    assert len(cache.k) == len(cache.v) == 3


def test_a_failed_grow_empties_the_cache(monkeypatch):
    """Growing goes a layer at a time (the peak is the new cache plus one old layer); an allocation
    that fails part way leaves an empty cache, consistent, which the engine resets after failing
    the requests it held."""
    cache = _cache()
    cache.ensure(2, 5)
    generation = cache.generation
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
    assert (cache.rows, cache.length, cache.k, cache.v) == (0, 0, [], []) and cache.generation > generation
    cache.ensure(40, 700)
    assert (cache.rows, cache.length) == (64, 1024)
