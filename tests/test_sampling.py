"""Sampling math: truncation masks, log-probs before truncation, seeds."""

from __future__ import annotations

import torch

from slime.engines.torch_engine.sampling import sample, truncate_probs
from slime.utils.sampling_params import SamplingParams


def test_truncate_top_k_top_p_min_p():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3)
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.8), SamplingParams(min_p=0.25)]
    kept = truncate_probs(probs, params) > 0
    assert kept[0].tolist() == [True, True, False, False, False]
    # mass before token 2 is 0.7 < 0.8 -> kept; before token 3 is 0.85 -> dropped
    assert kept[1].tolist() == [True, True, True, False, False]
    # min_p 0.25 * 0.5 = 0.125
    assert kept[2].tolist() == [True, True, True, False, False]


def test_truncation_respects_unsorted_order():
    probs = torch.tensor([[0.1, 0.6, 0.3]])
    kept = truncate_probs(probs, [SamplingParams(top_k=1)]) > 0
    assert kept.tolist() == [[False, True, False]]


def test_logprob_is_before_truncation_at_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    out = sample(logits, [SamplingParams(temperature=0.5, top_k=1)], [None], None)
    expected = torch.log_softmax(logits / 0.5, -1)[0, out.tokens[0]].item()
    assert abs(out.logprobs[0] - expected) < 1e-6
    out = sample(logits, [SamplingParams(temperature=0.0)], [None], None)
    assert out.tokens == [0]
    assert abs(out.logprobs[0] - torch.log_softmax(logits, -1)[0, 0].item()) < 1e-6


def test_sampling_distribution_and_seeds():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    params = [SamplingParams()] * 4000
    gen = torch.Generator().manual_seed(0)
    out = sample(logits, params, [None] * 4000, gen)
    freq = torch.bincount(torch.tensor(out.tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)
    # Truncated sampling never picks an excluded token.
    out = sample(logits[:500], [SamplingParams(top_p=0.6)] * 500, [None] * 500, gen)
    assert set(out.tokens) == {0}
    # A seeded row draws the same token whatever else is in the batch.
    seeded = [torch.Generator().manual_seed(5) for _ in range(2)]
    a = sample(logits[:1], [SamplingParams()], [seeded[0]], gen).tokens[0]
    b = sample(logits[:3], [SamplingParams()] * 3, [None, seeded[1], None], gen).tokens[1]
    assert a == b


def test_top_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    out = sample(logits, [SamplingParams(temperature=0)], [None], None, top_logprobs_nums=[2])
    assert [t for _, t in out.top_logprobs[0]] == [1, 3]
    assert sample(logits, [SamplingParams(temperature=0)], [None], None, [0]).top_logprobs is None


def test_top_logprobs_only_for_rows_that_ask():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 3)
    greedy = [SamplingParams(temperature=0)] * 3
    out = sample(logits, greedy, [None] * 3, None, top_logprobs_nums=[0, 3, 1])
    assert out.top_logprobs[0] == []
    assert [t for _, t in out.top_logprobs[1]] == [1, 3, 2]
    assert [t for _, t in out.top_logprobs[2]] == [1]
