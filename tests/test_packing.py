"""Packed micro-batches (slime.backends.fsdp.forward): samples back to back in one row, positions
restarting per sample, no padding. Their log-probs, entropies and gradients equal the padded
micro-batch's and a per-sample Hugging Face forward's, for mixed lengths."""

from __future__ import annotations

import random

import pytest
import torch

from slime.backends.fsdp.forward import make_micro_batch, response_log_probs


@pytest.fixture(scope="module", params=["sdpa", "eager", "slime_segments"])
def model(tiny_model, request):
    """The model under each attention implementation: Hugging Face's sdpa and eager (they find the
    samples' boundaries from the restarting positions) and ours (slime.backends.fsdp.packed_attention)."""
    from transformers import AutoModelForCausalLM

    from slime.backends.fsdp.packed_attention import register

    register()
    return AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation=request.param
    ).eval()


def _samples(n=6, seed=0):
    rng = random.Random(seed)
    tokens, response_lengths = [], []
    for _ in range(n):
        p, r = rng.randint(1, 12), rng.choice([1, 3, 9, 40])  # a long tail: one sample in four is 40
        tokens.append([rng.randint(3, 90) for _ in range(p + r)])
        response_lengths.append(r)
    return tokens, response_lengths


def _per_sample(model, tokens, response_lengths, temperature):
    """Each sample alone, the plain HF way: log p(token t | tokens < t) for its response tokens."""
    out = []
    for seq, r in zip(tokens, response_lengths):
        logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float() / temperature
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
        out.append(lp[-r:])
    return out


@torch.no_grad()
def test_packed_log_probs_equal_padded_and_per_sample_forwards(model):
    tokens, response_lengths = _samples()
    positions = list(range(len(tokens)))
    reference = _per_sample(model, tokens, response_lengths, 0.7)
    results = {}
    for packed in (False, True):
        mb = make_micro_batch(positions, tokens, response_lengths, None, torch.device("cpu"), packed=packed)
        results[packed] = response_log_probs(model, mb, 0.7, with_entropy=True)
    assert results[True][0].shape == results[False][0].shape
    for row, ref in enumerate(reference):
        r = response_lengths[row]
        for packed in (False, True):
            torch.testing.assert_close(results[packed][0][row, :r], ref, rtol=0, atol=1e-5)
            assert not results[packed][0][row, r:].any()  # nothing past the response
    torch.testing.assert_close(results[True][1], results[False][1], rtol=0, atol=1e-5)  # entropy
    assert results[True][1].abs().sum() > 0


def test_packed_gradients_equal_padded(model):
    tokens, response_lengths = _samples(seed=1)
    positions = list(range(len(tokens)))
    grads = {}
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        mb = make_micro_batch(positions, tokens, response_lengths, None, torch.device("cpu"), packed=packed)
        log_probs, entropy = response_log_probs(model, mb, 1.0, with_entropy=True)
        ((log_probs * mb.response_mask).sum() + 0.1 * (entropy * mb.response_mask).sum()).backward()
        grads[packed] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-4, atol=1e-5, msg=name)
