"""Packed micro-batches (slime.backends.fsdp.forward): samples back to back in one row, positions
restarting per sample, no padding. Their log-probs, entropies and gradients equal the padded
micro-batch's and a per-sample Hugging Face forward's, for mixed lengths."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from slime.backends.fsdp.forward import response_log_probs
from slime.backends.micro_batch import make_micro_batch


@pytest.fixture(scope="module", params=["sdpa", "eager", "slime_segments"])
def model(tiny_model, request):
    """The model under each attention implementation: Hugging Face's sdpa and eager (they find the
    samples' boundaries from the restarting positions) and ours (slime.backends.packed_attention)."""
    from transformers import AutoModelForCausalLM

    from slime.backends.packed_attention import register

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


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_log_probs_in_chunks_equal_the_whole_computation(model, packed):
    """--log-probs-chunk-size: the log-softmax over the vocabulary a few tokens at a time (each
    chunk recomputed in backward) gives the same values and gradients as all tokens at once."""
    tokens, response_lengths = _samples(seed=2)
    mb = make_micro_batch(
        list(range(len(tokens))), tokens, response_lengths, None, torch.device("cpu"), packed=packed
    )
    results = {}
    for chunk in (-1, 7):
        model.zero_grad(set_to_none=True)
        log_probs, entropy = response_log_probs(model, mb, 0.7, True, chunk)
        ((log_probs * mb.response_mask).sum() + 0.1 * entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[chunk] = (log_probs.detach(), entropy.detach(), grads)
    assert sum(response_lengths) > 7  # more than one chunk
    whole, chunked = results[-1], results[7]
    torch.testing.assert_close(chunked[0], whole[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(chunked[1], whole[1], rtol=0, atol=1e-6)
    for name, g in whole[2].items():
        torch.testing.assert_close(chunked[2][name], g, rtol=1e-5, atol=1e-7, msg=name)


def _megatron_log_probs(rank, world_size, init_method, model_dir, tp, pp, variants, batch):
    import dataclasses

    from slime.backends import make_train_actor
    from slime.config.train import BatchConfig, MegatronConfig
    from tests.test_fsdp_actor import base_config

    cfg = dataclasses.replace(
        base_config(model_dir),
        backend="megatron",
        megatron=MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
        rollout_temperature=0.7,
    )
    actor = make_train_actor(cfg, rank, world_size, init_method)
    actor.init()
    results = {}
    for name, batch_over in variants.items():  # the same weights, micro-batches laid out each way
        actor.backend.cfg = dataclasses.replace(
            cfg, batch=BatchConfig(global_batch_size=6, micro_batch_size=3, **batch_over)
        )
        results[name] = actor.compute_log_probs(batch)
    actor.close()
    return results


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_megatron_packed_log_probs_equal_per_sample_forwards(tiny_model, tp, pp):
    """The Megatron actor's packed micro-batches (megatron-core's THD layout; on CPU the local
    attention of slime.backends.megatron.attention) give each sample the log-probs of a Hugging
    Face forward of that sample alone, like the padded layout, with and without chunks."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from transformers import AutoModelForCausalLM

    from slime.utils.rollout_batch import RolloutBatch
    from tests.dist_helpers import run_ranks

    tokens, response_lengths = _samples(n=6, seed=3)
    batch = RolloutBatch(tokens, response_lengths, [0.0] * 6, list(range(6)))
    variants = {
        "packed": {},
        "padded": {"padded_micro_batches": True},
        "chunked": {"log_probs_chunk_size": 5},
    }
    ranks = run_ranks(tp * pp, _megatron_log_probs, tiny_model, tp, pp, variants, batch)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = _per_sample(hf, tokens, response_lengths, 0.7)
    for result in ranks:
        for name, values in result.items():
            assert sorted(values) == list(range(6)), name
            for i, ref in enumerate(reference):
                torch.testing.assert_close(torch.tensor(values[i]), ref, rtol=0, atol=1e-5, msg=f"{name} {i}")


@pytest.mark.parametrize("lengths", [[5, 3, 5, 7, 3, 5], [4, 4, 4, 4, 4, 4, 4]], ids=["mixed", "all-equal"])
def test_segments_of_equal_length_attend_like_separate_calls(lengths):
    """slime_segments batches samples of equal length into one attention call: each still sees
    only itself, causally (grouped-query heads)."""
    import torch.nn.functional as F

    from slime.backends.packed_attention import causal_per_segment

    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 4, sum(lengths), 8, generator=g),
        torch.randn(1, 2, sum(lengths), 8, generator=g),
        torch.randn(1, 2, sum(lengths), 8, generator=g),
    )
    got = causal_per_segment(q, k, v, torch.tensor(bounds))
    for a, b in itertools.pairwise(bounds):
        want = F.scaled_dot_product_attention(
            q[:, :, a:b],
            k[:, :, a:b].repeat_interleave(2, 1),
            v[:, :, a:b].repeat_interleave(2, 1),
            is_causal=True,
        )
        torch.testing.assert_close(got[:, :, a:b], want, rtol=0, atol=1e-6)


def test_a_row_padded_to_a_multiple_keeps_its_tail_apart():
    """Sequence parallelism pads a packed row to a multiple of TP: the tail is a segment of its own
    (positions restarting, its own bound), and the predictions of the samples do not move."""
    tokens, response_lengths = [[5, 6, 7, 8], [9, 10, 11]], [2, 1]
    plain = make_micro_batch([0, 1], tokens, response_lengths, None, torch.device("cpu"), packed=True)
    padded = make_micro_batch(
        [0, 1], tokens, response_lengths, None, torch.device("cpu"), packed=True, multiple_of=4
    )
    assert padded.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 0]]
    assert padded.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert plain.cu_seq_lens().tolist() == [0, 4, 7] and padded.cu_seq_lens().tolist() == [0, 4, 7, 8]
    assert padded.longest_segment() == 4
    rows, cols, targets = padded.predictions()
    assert rows.tolist() == [0, 0, 0]  # one packed row
    assert cols.tolist() == [1, 2, 5] and targets.tolist() == [7, 8, 11]
    assert all(torch.equal(a, b) for a, b in zip(plain.predictions(), padded.predictions()))
    assert padded.scatter(torch.tensor([1.0, 2.0, 3.0])).tolist() == [[1.0, 2.0], [3.0, 0.0]]
    right = make_micro_batch([0, 1], tokens, response_lengths, None, torch.device("cpu"), multiple_of=3)
    assert right.input_ids.shape == (2, 6) and right.attention_mask.sum().item() == 7


def test_packed_forward_with_a_tail_equals_without(model):
    tokens, response_lengths = _samples(seed=4)
    positions = list(range(len(tokens)))
    with torch.no_grad():
        values = [
            response_log_probs(
                model,
                make_micro_batch(
                    positions, tokens, response_lengths, None, torch.device("cpu"), packed=True, multiple_of=m
                ),
                1.0,
                True,
            )
            for m in (1, 16)
        ]
    torch.testing.assert_close(values[1][0], values[0][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(values[1][1], values[0][1], rtol=0, atol=1e-5)


def test_slime_segments_refuses_what_it_cannot_do():
    from slime.backends.packed_attention import segment_attention

    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match=r"sliding_window.*--padded-micro-batches"):
        segment_attention(torch.nn.Module(), q, q, q, None, sliding_window=4)
