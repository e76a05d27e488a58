"""The torch engine's CUDA decode path, held on CPU: bucketed decode shapes (counted per step), the
plan-free decode attention, live-key attention, decode rounds, and one host transfer per round."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from slime.engines.client import EngineClient
from slime.engines.torch_engine.attention import decode_attention, sdpa_masked
from slime.engines.torch_engine.model_runner import BatchedRunner
from slime.engines.torch_engine.shapes import DecodeShapes, bucket
from slime.utils import transfer
from tests.inprocess import InProcessServer
from tests.test_engine_lora import adapters  # noqa: F401 - a fixture
from tests.test_engine_server import teacher_forced_logprobs


def test_buckets_cover_every_size_with_little_padding():
    sizes = range(1, 4097)
    buckets = [bucket(n, 128) for n in sizes]
    assert all(b >= n for b, n in zip(buckets, sizes))
    assert all(b <= max(1.25 * n, 128) for b, n in zip(buckets, sizes) if n > 1)
    assert buckets == sorted(buckets)  # monotone: a longer context never gets a shorter bucket
    assert len(set(buckets)) <= 28  # 8 powers of two up to 128, then 4 per octave up to 4096
    assert bucket(300, 8, limit=256) == 300  # a limit below n never truncates
    assert [bucket(n) for n in (1, 3, 5, 9, 17, 100, 256)] == [1, 4, 8, 10, 20, 112, 256]
    with pytest.raises(ValueError):
        bucket(0)
    exact = DecodeShapes(False, 64, 1024)
    assert (exact.rows(37), exact.keys(301)) == (37, 301)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_sdpa_with_grouped_heads(dtype):
    g = torch.Generator().manual_seed(0)
    B, H, KV, S, D = 5, 8, 2, 37, 16
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    k, v = (torch.randn(B, KV, S, D, generator=g).to(dtype) for _ in range(2))
    lengths = torch.tensor([1, 9, 37, 20, 2])
    mask = (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :]
    got = decode_attention(q, k, v, mask, 0.25)
    want = sdpa_masked(q.float(), k.float(), v.float(), mask, 0.25)
    tol = 1e-6 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # The query heads of one KV head are consecutive: heads 0-3 read KV head 0 alone.
    k2 = k.clone()
    k2[:, 1] = 0
    changed = decode_attention(q, k2, v, mask, 0.25)
    assert torch.equal(changed[:, :4], got[:, :4]) and not torch.equal(changed[:, 4:], got[:, 4:])


def _requests(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(4, 90) for _ in range(rng.randint(3, 40))], rng.randint(2, 30)) for _ in range(n)]


asynchronous: list = []  # the last _serve's copies down, "async" for the overlapped ones
shapes: list = []  # the last _serve's decode forwards: (rows, key length)


def _serve(
    model: str,
    bucketed: bool,
    reqs,
    overlap: bool = False,
    steps: int = 1,
    live_keys=None,
    context: int | None = None,
    compile_max_bs: int = 0,
    **params,
) -> tuple[list, BatchedRunner, int, int]:
    """Run `reqs` through an in-process engine whose batched runner does (not) bucket its decode
    shapes (and does or not overlap its decode rounds of at most `steps` steps; `live_keys`: its
    live-key decode kernel; `context`: its context length; `compile_max_bs`: its
    torch_compile_max_bs); returns the results, the runner, the engine's steps and the host
    transfers made."""
    server = InProcessServer(
        model,
        max_running_requests=16,
        overlap_schedule=overlap,
        num_continuous_decode_steps=steps,
        context_length=context,
    )
    engine = server.engine
    engine.runner = runner = BatchedRunner(
        engine.model,
        16,
        engine.context_length,
        bucket_shapes=bucketed,
        live_keys=live_keys,
        torch_compile_max_bs=compile_max_bs,
    )
    shapes.clear()
    forward = runner._decode_forward
    runner._decode_forward = lambda inputs, key_len, first_row=0: (  # type: ignore[method-assign]
        shapes.append((inputs.shape[1], key_len)) or forward(inputs, key_len, first_row)
    )
    calls = []
    original = transfer.to_host

    original_async = transfer.to_host_async

    def counting(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor.shape)
        return original(tensor)

    def counting_async(tensor: torch.Tensor) -> transfer.HostCopy:
        calls.append("async")
        return original_async(tensor)

    async def scenario(url: str):
        async with EngineClient(url) as c:
            return await asyncio.gather(
                *[
                    c.generate(
                        input_ids=p,
                        return_logprob=True,
                        sampling_params={
                            "temperature": 1.0,
                            "max_new_tokens": m,
                            "ignore_eos": True,
                            "sampling_seed": i,
                            **params,
                        },
                    )
                    for i, (p, m) in enumerate(reqs)
                ]
            )

    transfer.to_host, transfer.to_host_async = counting, counting_async
    try:
        with server:
            results = asyncio.run(scenario(server.url))
    finally:
        transfer.to_host, transfer.to_host_async = original, original_async
    asynchronous[:] = calls
    return results, engine.runner, engine.num_steps, len(calls)


def _assert_same(results, reference) -> None:
    for a, b in zip(reference, results, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        got = torch.tensor([x[0] for x in b["meta_info"]["output_token_logprobs"]])
        want = torch.tensor([x[0] for x in a["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_bucketed_decode_shapes_repeat_and_change_no_result(tiny_model):
    reqs = _requests(24)
    exact, exact_runner, _, _ = _serve(tiny_model, False, reqs)
    exact_shapes = list(shapes)
    bucketed, runner, steps, transfers = _serve(tiny_model, True, reqs)
    _assert_same(bucketed, exact)
    decode_steps = sum(runner.decode_shapes.values())
    assert decode_steps == len(shapes) > 30 and sorted(runner.decode_shapes.elements()) == sorted(shapes)
    # Exact shapes: nearly every decode step is a shape of its own (keys grow by one per step). The
    # two runs may batch the requests differently (they arrive over HTTP), so their step counts differ.
    assert len(exact_shapes) > 30 and len(set(exact_shapes)) > 0.8 * len(exact_shapes)
    assert not exact_runner.decode_shapes  # counted only when bucketed (bounded)
    # Bucketed: a few shapes, each a bucket of rows x a bucket of keys, most steps on a repeat.
    assert len(runner.decode_shapes) < decode_steps / 3
    for rows, keys in runner.decode_shapes:
        assert rows == bucket(rows, 8, 16) and keys == bucket(keys, 128)
    # One synchronising copy down per engine step (prefill or decode): tokens and log-probs.
    assert transfers == steps


def test_top_logprobs_cost_one_more_copy_only_when_asked():
    from slime.engines.torch_engine.sampling import sample
    from slime.utils.sampling_params import SamplingParams

    calls = []
    original = transfer.to_host

    def counting(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return original(tensor)

    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
    ]
    gen = torch.Generator().manual_seed(1)
    transfer.to_host = counting
    try:
        plain = sample(logits, params, [None, None, torch.Generator().manual_seed(5)], gen)
        assert len(calls) == 1
        top = sample(logits, params, [None, None, None], gen, [0, 2, 0])
        assert len(calls) == 3
    finally:
        transfer.to_host = original
    assert plain.tokens[0] == int(logits[0].argmax()) and all(isinstance(t, int) for t in plain.tokens)
    want = torch.log_softmax(logits[0], -1)[plain.tokens[0]].item()
    assert plain.logprobs[0] == want
    assert top.top_logprobs is not None and top.top_logprobs[0] == [] and len(top.top_logprobs[1]) == 2


@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "bucketed"])
def test_overlapped_decoding_gives_the_same_answers(tiny_model, bucketed):
    """Launching each decode step before booking the previous one: every request gets the tokens,
    log-probs and finish reason it gets without overlap, with ignore_eos (length stops, one
    request per step finishing at the context limit) and without it (EOS and stop-string stops
    found one step late on the host), and each step still copies down once."""
    reqs = _requests(24, seed=1)
    context = 72  # the engines' context length (every request fits): the longest request ends there
    reqs[3] = (reqs[3][0], context - len(reqs[3][0]))
    reqs[5] = (reqs[5][0], 1)
    plain, _, _, _ = _serve(tiny_model, bucketed, reqs, context=context)
    overlapped, _, steps, transfers = _serve(tiny_model, bucketed, reqs, overlap=True, context=context)
    _assert_same(overlapped, plain)
    assert overlapped[3]["meta_info"]["completion_tokens"] == context - len(reqs[3][0])
    # One copy per launched step; the steps counted are the booked ones, and the last launch
    # (its sequences all finished a step earlier) may still be in flight when the engine stops.
    assert steps <= transfers <= steps + 1 and asynchronous.count("async") > steps / 2
    stops = {"ignore_eos": False, "stop": ["a", "7"], "stop_token_ids": [40, 41, 42]}
    plain, _, _, _ = _serve(tiny_model, bucketed, reqs, context=context, **stops)
    overlapped, _, _, _ = _serve(tiny_model, bucketed, reqs, overlap=True, context=context, **stops)
    _assert_same(overlapped, plain)
    assert sum(r["meta_info"]["finish_reason"]["type"] == "stop" for r in plain) >= 5


@pytest.mark.parametrize("overlap", [False, True], ids=["booked", "overlapped"])
def test_decode_rounds_give_the_same_answers(tiny_model, hf_model, overlap):
    """Rounds of up to 4 decode steps per host round trip: every request gets the tokens,
    log-probs and finish reason it gets one step at a time (seeded rows draw the same noise),
    with length stops (rounds shrink so no request passes its max_new_tokens, one at the context
    limit) and with stop tokens and stop strings inside a round (the tokens after them dropped);
    a round copies down once."""
    reqs = _requests(24, seed=3)
    context = 72  # the engines' context length (every request fits): the longest request ends there
    reqs[2] = (reqs[2][0], context - len(reqs[2][0]))
    reqs[7] = (reqs[7][0], 1)
    plain, _, _, _ = _serve(tiny_model, False, reqs, context=context)
    rounds, _, _, _ = _serve(tiny_model, False, reqs, overlap=overlap, steps=4, context=context)
    _assert_same(rounds, plain)
    assert rounds[2]["meta_info"]["completion_tokens"] == context - len(reqs[2][0])
    for (prompt, _), result in list(zip(reqs, rounds))[:6]:  # and the model's own numbers
        got = torch.tensor([x[0] for x in result["meta_info"]["output_token_logprobs"]])
        want = teacher_forced_logprobs(hf_model, prompt, result["output_ids"], 1.0)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    stops = {"ignore_eos": False, "stop": ["a", "7"], "stop_token_ids": [40, 41, 42]}
    plain, _, _, _ = _serve(tiny_model, False, reqs, **stops)
    rounds, _, _, _ = _serve(tiny_model, False, reqs, overlap=overlap, steps=4, **stops)
    _assert_same(rounds, plain)
    assert sum(r["meta_info"]["finish_reason"]["type"] == "stop" for r in plain) >= 5
    ids_only = {"ignore_eos": False, "stop_token_ids": [40, 41, 42, 43, 44]}
    plain, _, _, _ = _serve(tiny_model, False, reqs, **ids_only)
    rounds, _, _, _ = _serve(tiny_model, False, reqs, overlap=overlap, steps=4, **ids_only)
    _assert_same(rounds, plain)
    assert sum(r["meta_info"]["finish_reason"]["type"] == "stop" for r in plain) >= 5


@pytest.mark.parametrize(("overlap", "launched"), [(False, [4, 4, 4, 4]), (True, [4, 4, 4, 4, 1])])
def test_a_round_copies_down_once(tiny_model, overlap, launched):
    """8 requests of 17 tokens, prefilled together: 16 decode steps in rounds of 4, one copy down
    each; overlapped, a last one-step round runs while the fourth is booked (its tokens dropped,
    as one-step overlap drops one)."""
    from slime.engines.protocol import parse_generate
    from slime.engines.torch_engine.config import EngineConfig
    from slime.engines.torch_engine.engine import TorchEngine

    engine = TorchEngine(
        EngineConfig(tiny_model, num_threads=1, overlap_schedule=overlap, num_continuous_decode_steps=4)
    )
    body = {
        "input_ids": [[5 + i] * (3 + i) for i in range(8)],
        "sampling_params": {"max_new_tokens": 17, "ignore_eos": True, "temperature": 1.0},
    }
    done: list = []
    added = engine.add([engine.make_sequence(r, done.append) for r in parse_generate(body)[0]])
    engine._run_commands()
    added.result()
    assert engine.rounds is not None
    sizes, copies = [], []
    size, to_host_async = engine.rounds.round_size, transfer.to_host_async
    rounds: Any = engine.rounds  # its round_size replaced by a recording one
    rounds.round_size = lambda seqs: sizes.append(size(seqs)) or sizes[-1]
    transfer.to_host_async = lambda t: copies.append(t.shape) or to_host_async(t)
    try:
        while engine.scheduler.has_work():
            engine._step()
        engine._book_in_flight()
    finally:
        transfer.to_host_async = to_host_async
    assert sizes == launched and copies == [(2, k, 8) for k in launched]
    assert sorted(len(s.output_ids) for s in done) == [17] * 8


def poisoning_flash_contract(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k, scale):
    """What the flash varlen kernel computes (row i's queries over keys cu_k[i] + [0, seqused_k[i]),
    grouped-query heads), on any device; first it writes NaN into every key and value past each
    row's live ones, so a caller that relied on any of them would get NaN."""
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        start, live = int(cu_k[i]), int(seqused_k[i])
        assert 0 < live <= max_k and int(cu_q[i + 1]) - int(cu_q[i]) <= max_q
        end = int(cu_k[i + 1]) if i + 1 < len(cu_k) else k.shape[0]
        k[start + live : end] = float("nan")
        v[start + live : end] = float("nan")
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        qi, ki, vi = (
            t.transpose(0, 1)[None] for t in (q[rows], k[start : start + live], v[start : start + live])
        )
        out[rows] = F.scaled_dot_product_attention(qi, ki, vi, scale=scale, enable_gqa=groups > 1)[
            0
        ].transpose(0, 1)
    return out


@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "bucketed"])
def test_live_key_decoding_gives_the_same_answers(tiny_model, bucketed):
    """Decode attention over each row's live keys alone (the token-major cache and the arguments
    the flash kernel is called with, the kernel replaced by its contract on CPU): every request
    gets the tokens and log-probs of the padded-key kernels, through row moves as requests finish,
    cache regrowth, padding rows, and rounds, though every key past a row's live ones is NaN."""
    reqs = _requests(24, seed=4)
    plain, _, _, _ = _serve(tiny_model, bucketed, reqs)
    live, runner, _, _ = _serve(tiny_model, bucketed, reqs, live_keys=poisoning_flash_contract)
    assert runner.cache.token_major and runner.stats()["decode_attention"] == "live keys"
    _assert_same(live, plain)
    rounds, _, _, _ = _serve(
        tiny_model, bucketed, reqs, overlap=True, steps=4, live_keys=poisoning_flash_contract
    )
    _assert_same(rounds, plain)


def test_a_round_never_takes_a_sequence_past_its_max_new_tokens():
    from slime.engines.torch_engine.rounds import DecodeRounds, PendingRound
    from slime.engines.torch_engine.sequence import Sequence
    from slime.utils.sampling_params import SamplingParams

    def seq(max_new: int, made: int) -> Sequence:
        return Sequence("r", [1, 2], SamplingParams(max_new_tokens=max_new), output_ids=[5] * made)

    rounds = DecodeRounds(None, steps=4, overlap=True)
    assert rounds.round_size([seq(100, 0), seq(100, 90)]) == 4
    assert rounds.round_size([seq(100, 0), seq(100, 97)]) == 3  # its last 3 tokens
    rounds.pending = PendingRound([], torch.zeros(0), transfer.to_host_async(torch.zeros(1)), 2)
    assert rounds.round_size([seq(100, 0), seq(100, 96)]) == 2  # 2 more are in flight
    assert rounds.round_size([seq(100, 0), seq(100, 98)]) == 1  # all in flight: one step, as overlap does


def test_bucketed_decode_gives_padding_rows_no_adapter(tiny_model, adapters):
    """LoRA rows in a batch padded to a bucket (3 rows -> 4): each real row keeps its adapter,
    the same answers as exact shapes."""
    from tests.test_engine_lora import PROMPTS

    def run(bucketed: bool) -> list[dict]:
        server = InProcessServer(tiny_model, enable_lora=True, lora_paths=(("a1", adapters["a1"]),))
        engine = server.engine
        engine.runner = BatchedRunner(engine.model, 64, engine.context_length, bucket_shapes=bucketed)
        engine.runner.adapters = engine.adapters

        async def scenario(url: str):
            async with EngineClient(url) as c:
                return await c.generate(
                    input_ids=PROMPTS,
                    lora_path=["a1", None, "a1"],
                    return_logprob=True,
                    sampling_params={"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
                )

        with server:
            return asyncio.run(scenario(server.url))

    _assert_same(run(True), run(False))


def _watch_overlap(tiny_model, probe: bool) -> tuple[list, list[bool], list[bool]]:
    """12 requests through an overlapping engine that runs 4 at once (later ones are admitted as
    others finish); returns the results, whether each admission found a step in flight, and
    (with `probe`) whether each command run between steps (sent every millisecond) did."""
    server = InProcessServer(tiny_model, max_running_requests=4, overlap_schedule=True)
    engine = server.engine
    admitted: list[bool] = []
    plan = engine.scheduler.plan

    def watched_plan():
        if engine.scheduler.admits():
            admitted.append(engine.rounds.pending is not None)
        return plan()

    engine.scheduler.plan = watched_plan  # type: ignore[method-assign]
    reqs = _requests(12, seed=2)

    async def scenario(url: str):
        async with EngineClient(url) as c:
            jobs = asyncio.gather(
                *[
                    c.generate(input_ids=p, sampling_params={"max_new_tokens": m, "ignore_eos": True})
                    for p, m in reqs
                ]
            )
            seen = []
            while probe and not jobs.done():
                seen.append(await asyncio.wrap_future(engine.call(lambda: engine.rounds.pending is not None)))
                await asyncio.sleep(0.001)
            return await jobs, seen

    with server:
        results, seen = asyncio.run(scenario(server.url))
    assert [r["meta_info"]["completion_tokens"] for r in results] == [m for _, m in reqs]
    return results, admitted, seen


def test_overlapped_steps_are_booked_before_admissions(tiny_model):
    _, admitted, _ = _watch_overlap(tiny_model, probe=False)
    assert len(admitted) > 3 and not any(admitted)


def test_overlapped_steps_are_booked_before_commands(tiny_model):
    _, _, seen = _watch_overlap(tiny_model, probe=True)
    assert len(seen) > 5 and not any(seen)
