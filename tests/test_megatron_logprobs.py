"""Vocabulary-parallel log-probs and entropy (slime.backends.megatron.logprobs): equal to a plain
log-softmax over the real vocabulary, the padding excluded and given zero gradient; on gloo ranks."""

from __future__ import annotations

import pytest
import torch

from slime.backends.megatron.logprobs import vocab_parallel_log_probs
from tests.dist_helpers import run_ranks

VOCAB, PADDED = 101, 128  # e.g. --make-vocab-size-divisible-by 32 at TP 4


def reference(logits: torch.Tensor, targets: torch.Tensor):
    logits = logits[..., :VOCAB].detach().requires_grad_(True)
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp.sum() + 0.5 * ent.sum()).backward()
    return lp.detach(), ent.detach(), logits.grad


def data():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, PADDED, generator=g, dtype=torch.float64) * 3
    logits[..., VOCAB:] = 0.0  # zero padding rows give zero logits
    targets = torch.randint(0, VOCAB, (3, 7), generator=g)
    targets[0, 0], targets[1, 1] = 0, VOCAB - 1  # the first and last real ids
    return logits, targets


def on_rank(rank, world_size, init_method):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    logits, targets = data()
    shard = PADDED // world_size
    mine = logits[..., rank * shard : (rank + 1) * shard].clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(mine, targets, VOCAB, rank, world_size, None, with_entropy=True)
    (lp.sum() + 0.5 * ent.sum()).backward()
    dist.destroy_process_group()
    return lp.detach(), ent.detach(), mine.grad


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_log_probs_match_a_log_softmax_over_the_real_vocabulary(tp):
    logits, targets = data()
    want_lp, want_ent, want_grad = reference(logits, targets)
    if tp == 1:
        x = logits.clone().requires_grad_(True)
        lp, ent = vocab_parallel_log_probs(x, targets, VOCAB, with_entropy=True)
        (lp.sum() + 0.5 * ent.sum()).backward()
        results = [(lp.detach(), ent.detach(), x.grad)]
    else:
        results = run_ranks(tp, on_rank)
    grad = torch.cat([g for _, _, g in results], dim=-1)
    for lp, ent, _ in results:  # every TP rank ends with the full answer
        torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-12)
        torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad[..., :VOCAB], want_grad, rtol=0, atol=1e-12)
    assert torch.count_nonzero(grad[..., VOCAB:]) == 0 and torch.isfinite(grad).all()
    # With 4 ranks of 32 columns, rank 3 holds columns 96..127: 5 real ids and 27 padding.
