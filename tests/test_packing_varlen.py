"""The call of torch's varlen attention kernel (slime.backends.packed_attention._varlen), on
CPU against stand-ins with each torch release's signature: the kernel only runs on a GPU, but
which keywords the call passes, and whether grouped-query heads are repeated first, is decided
here. The first GPU run (torch 2.11) failed with `unexpected keyword argument 'enable_gqa'`."""

from __future__ import annotations

import logging

import pytest
import torch

from slime.backends import packed_attention

BOUNDS = [0, 5, 22, 25, 65, 74]
HEADS, KV_HEADS, DIM = 8, 2, 16  # grouped-query: 4 query heads per key/value head


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, BOUNDS[-1], DIM, generator=g)
    k, v = (torch.randn(1, KV_HEADS, BOUNDS[-1], DIM, generator=g) for _ in range(2))
    return q, k, v


def loop(q, k, v, cu, scale=None, window_size=None, is_causal=None, enable_gqa=False):
    """What the kernel computes, on [tokens, heads, dim] inputs: the per-segment loop's result
    (which repeats grouped-query heads itself)."""
    assert window_size in (None, (-1, 0)) and is_causal in (None, True), "the call must be causal"
    out = packed_attention._per_segment(*(t.transpose(0, 1)[None] for t in (q, k, v)), cu, scale, 0.0)
    return out[0].transpose(0, 1)


def stand_ins() -> dict[str, tuple]:
    """A fresh stand-in per torch release (fresh: the call plan is cached per kernel), and the
    head counts of the keys each received."""
    seen: list[int] = []

    def torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        seen.append(key.shape[1])
        assert key.shape[1] == query.shape[1], "torch 2.10's kernel got grouped-query heads"
        return loop(query, key, value, cu_seq_q, is_causal=is_causal)

    def torch_2_11(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
    ):
        seen.append(key.shape[1])
        assert key.shape[1] == query.shape[1], "torch 2.11's kernel got grouped-query heads"
        return loop(query, key, value, cu_seq_q, scale, window_size)

    def torch_2_12(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
        num_splits=None,
    ):
        seen.append(key.shape[1])
        assert enable_gqa == (key.shape[1] != query.shape[1])
        return loop(query, key, value, cu_seq_q, scale, window_size)

    def no_causal_keyword(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        raise AssertionError("a kernel that cannot be told to be causal must not be called")

    return {
        "2.10": (torch_2_10, seen),
        "2.11": (torch_2_11, seen),
        "2.12": (torch_2_12, seen),
        "none": (no_causal_keyword, seen),
    }


@pytest.mark.parametrize("release, kv_heads_seen", [("2.11", HEADS), ("2.12", KV_HEADS), ("2.10", HEADS)])
@pytest.mark.parametrize("scale", [None, DIM**-0.5], ids=["no-scale", "default-scale"])
def test_the_call_fits_the_installed_kernel(monkeypatch, release, kv_heads_seen, scale):
    kernel, seen = stand_ins()[release]
    monkeypatch.setattr(packed_attention, "_varlen_kernel", lambda: kernel)
    q, k, v = inputs()
    cu = torch.tensor(BOUNDS)
    want = packed_attention.causal_per_segment(q, k, v, cu, scale=scale)  # CPU: the loop runs
    got = packed_attention._varlen(q, k, v, cu, None, scale)
    assert got is not None and seen == [kv_heads_seen]
    torch.testing.assert_close(got, want)


def test_a_custom_scale_reaches_the_kernel_or_the_loop_runs(monkeypatch):
    q, k, v = inputs(1)
    cu = torch.tensor(BOUNDS)
    want = packed_attention.causal_per_segment(q, k, v, cu, scale=0.3)
    for release, called in [("2.11", True), ("2.10", False)]:  # 2.10's kernel takes no scale
        kernel, seen = stand_ins()[release]
        monkeypatch.setattr(packed_attention, "_varlen_kernel", lambda kernel=kernel: kernel)
        got = packed_attention._varlen(q, k, v, cu, None, 0.3)
        assert (got is not None) == called and bool(seen) == called, release
        if got is not None:
            torch.testing.assert_close(got, want)


def test_a_kernel_that_lacks_a_needed_keyword_falls_back_to_the_loop(monkeypatch, caplog):
    """causal_per_segment itself (the dispatch): the loop's result, not a TypeError; the choice
    logged once."""
    kernel, _ = stand_ins()["none"]
    monkeypatch.setattr(packed_attention, "_varlen_kernel", lambda: kernel)
    monkeypatch.setattr(packed_attention, "_varlen_applies", lambda query, dropout_p: True)
    q, k, v = inputs(2)
    cu = torch.tensor(BOUNDS)
    with caplog.at_level(logging.INFO, logger=packed_attention.__name__):
        outs = [packed_attention.causal_per_segment(q, k, v, cu, 40, 0.25) for _ in range(2)]
    monkeypatch.setattr(packed_attention, "_varlen_applies", lambda query, dropout_p: False)
    want = packed_attention.causal_per_segment(q, k, v, cu, 40, 0.25)
    for out in outs:
        torch.testing.assert_close(out, want)
    chosen = [r.getMessage() for r in caplog.records if "packed attention" in r.getMessage()]
    assert len(chosen) == 1 and "per-segment loop" in chosen[0] and "window_size or is_causal" in chosen[0]


@pytest.mark.parametrize("release", ["2.11", "2.12"])
def test_the_dispatch_uses_the_kernel_with_grouped_query_heads(monkeypatch, caplog, release):
    kernel, seen = stand_ins()[release]
    monkeypatch.setattr(packed_attention, "_varlen_kernel", lambda: kernel)
    monkeypatch.setattr(packed_attention, "_varlen_applies", lambda query, dropout_p: True)
    q, k, v = (t.requires_grad_() for t in inputs(3))
    cu = torch.tensor(BOUNDS)
    with caplog.at_level(logging.INFO, logger=packed_attention.__name__):
        got = packed_attention.causal_per_segment(q, k, v, cu, 40, 0.125)
    got.square().sum().backward()
    grads = [t.grad for t in (q, k, v)]
    monkeypatch.setattr(packed_attention, "_varlen_applies", lambda query, dropout_p: False)
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = packed_attention.causal_per_segment(*ref, cu, 40, 0.125)
    want.square().sum().backward()
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, (t.grad for t in ref)):  # the repeat's backward sums over the group
        torch.testing.assert_close(a, b)
    assert seen == [HEADS if release == "2.11" else KV_HEADS]
    (message,) = [r.getMessage() for r in caplog.records if "packed attention" in r.getMessage()]
    assert "varlen_attn" in message and ("repeated" in message) == (release == "2.11")
