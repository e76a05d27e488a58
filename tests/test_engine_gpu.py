"""GPU checks of the torch engine (skipped without CUDA): cuda device, log-prob parity, NCCL updates."""

from __future__ import annotations

import asyncio

import pytest
import torch

from slime.engines.client import EngineClient
from tests.conftest import start_engine
from tests.test_engine_server import teacher_forced_logprobs

pytestmark = pytest.mark.gpu


def test_cuda_engine_logprob_parity(tiny_model, hf_model, tmp_path):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with start_engine(tiny_model, tmp_path, "--device", "cuda") as eng:

        async def scenario():
            async with EngineClient(eng.url) as c:
                return await c.generate(
                    prompts, sampling_params={"max_new_tokens": 16, "ignore_eos": True}, return_logprob=True
                )

        results = asyncio.run(scenario())
    for prompt, res in zip(prompts, results, strict=True):
        got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        ref = teacher_forced_logprobs(hf_model, prompt, res["output_ids"], 1.0)
        # TF32 / kernel differences on GPU: looser than the CPU bound.
        assert (got - ref).abs().max().item() < 1e-3


def _server_state(url: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{url}/get_server_info", timeout=30) as r:
        return json.load(r)["internal_states"][0]


def _seeded_run(url: str, reqs: list[tuple[list[int], int]]) -> list[dict]:
    async def scenario():
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
                        },
                    )
                    for i, (p, m) in enumerate(reqs)
                ]
            )

    return asyncio.run(scenario())


def test_cuda_graphs_replay_what_eager_decoding_computes(tiny_model, tmp_path):
    """The same seeded requests with CUDA graphs and with --disable-cuda-graph: the same tokens and
    log-probs (same bucketed shapes, same kernels); graphs were captured and replayed. And with
    --disable-overlap-schedule, rounds of 4 steps and --enable-torch-compile: the same tokens."""
    import random

    rng = random.Random(0)
    reqs = [
        ([rng.randrange(4, 90) for _ in range(rng.randint(3, 30))], rng.randint(4, 30)) for _ in range(20)
    ]
    runs = {}
    for name, flags in (
        ("graphs", []),
        ("eager", ["--disable-cuda-graph"]),
        ("booked", ["--disable-overlap-schedule"]),
        ("rounds", ["--num-continuous-decode-steps", "4"]),
        ("compiled", ["--enable-torch-compile", "--torch-compile-max-bs", "16"]),
    ):
        with start_engine(tiny_model, tmp_path, "--device", "cuda", *flags) as eng:
            runs[name] = (_seeded_run(eng.url, reqs), _server_state(eng.url))
    graphs, eager = runs["graphs"], runs["eager"]
    print("engine state with graphs:", graphs[1], "\nwithout:", eager[1])
    assert graphs[1]["cuda_graphs"] > 0 and graphs[1]["cuda_graph_replays"] > 0
    assert "cuda_graphs" not in eager[1] and graphs[1]["bucketed_shapes"] is True
    worst = _same_tokens_logprob_gap(graphs[0], eager[0])
    print(f"max |graph - eager| log-prob: {worst:.3g}")
    assert worst <= 1e-6
    # Without the overlap schedule a finished request leaves the batch one step sooner, so a
    # batch can fall into another bucket (other kernel shapes): the same tokens, float32 rounding.
    worst = _same_tokens_logprob_gap(graphs[0], runs["booked"][0])
    print(f"max |overlapped - booked| log-prob: {worst:.3g}")
    assert worst <= 1e-4
    # Rounds of 4 decode steps per host round trip: seeded rows draw the same noise; the batch
    # shrinks at other steps (as booked), so the same float32 tolerance.
    worst = _same_tokens_logprob_gap(graphs[0], runs["rounds"][0])
    print(f"max |one step - rounds of 4| log-prob: {worst:.3g}")
    assert worst <= 1e-4
    # torch.compile inside the graphs: Inductor's fused kernels sum in another order.
    compiled = runs["compiled"][1]
    assert compiled["torch_compile_calls"] > 0 and "torch_compile_failed" not in compiled, compiled
    worst = _same_tokens_logprob_gap(graphs[0], runs["compiled"][0])
    print(f"max |eager - compiled| log-prob: {worst:.3g}")
    assert worst <= 1e-4


def test_live_key_attention_equals_the_padded_kernel_on_cuda():
    """The flash kernel over each row's live keys (token-major cache) against the batched-matmul
    kernel over padded keys (head-major, masked), bfloat16: the same attention within bfloat16's
    rounding, and NaN past a row's live keys changes nothing (they are never read)."""
    from slime.engines.torch_engine.attention import (
        LiveRows,
        decode_attention,
        live_decode_attention,
        live_keys_kernel,
    )

    device = torch.device("cuda")
    kernel = live_keys_kernel(device, torch.bfloat16, 64)
    assert kernel is not None, f"torch {torch.__version__}'s flash op takes no seqused_k on this GPU"
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, KV, L, D = 6, 16, 8, 256, 64
    q = torch.randn(B, H, 1, D, generator=g, device=device, dtype=torch.bfloat16)
    cache = torch.randn(2, B + 2, L, KV, D, generator=g, device=device, dtype=torch.bfloat16)  # K, V
    live = torch.tensor([1, 17, 256, 100, 2, 64], device=device)
    first_row = 2  # the batch's rows start past others'
    layout = LiveRows.of(live - 1, first_row, L)  # positions: each row's last live key
    got = live_decode_attention(q, cache[0], cache[1], layout, D**-0.5, kernel)
    rows = cache[:, first_row : first_row + B].transpose(2, 3)  # head-major views
    mask = (torch.arange(L, device=device)[None, :] < live[:, None])[:, None, None, :]
    want = decode_attention(q, rows[0], rows[1], mask, D**-0.5)
    err = (got.float() - want.float()).abs().max().item()
    print(f"max |live keys (flash) - padded keys (bmm)|: {err:.3g}")
    assert err < 2e-2
    for i, n in enumerate(live.tolist()):
        cache[:, first_row + i, n:] = float("nan")
    poisoned = live_decode_attention(q, cache[0], cache[1], layout, D**-0.5, kernel)
    assert torch.equal(poisoned, got)


def test_live_key_engine_stays_as_close_to_transformers_as_the_padded_kernels(tiny_model, hf_model, tmp_path):
    """A bfloat16 engine with --attention-backend flash and one with torch_native: each one's
    sampled log-probs against transformers' float32 forward of its own tokens; flash is no further
    off than bfloat16 rounding already puts the padded kernels."""
    import random

    rng = random.Random(1)
    reqs = [
        ([rng.randrange(4, 90) for _ in range(rng.randint(3, 60))], rng.randint(8, 40)) for _ in range(16)
    ]
    gaps = {}
    for backend in ("flash", "torch_native"):
        flags = ["--device", "cuda", "--dtype", "bfloat16", "--attention-backend", backend]
        with start_engine(tiny_model, tmp_path, *flags) as eng:
            results, state = _seeded_run(eng.url, reqs), _server_state(eng.url)
        assert state["decode_attention"] == ("live keys" if backend == "flash" else "padded keys")
        gaps[backend] = max(
            (
                torch.tensor([x[0] for x in r["meta_info"]["output_token_logprobs"]])
                - teacher_forced_logprobs(hf_model, p, r["output_ids"], 1.0)
            )
            .abs()
            .max()
            .item()
            for (p, _), r in zip(reqs, results, strict=True)
        )
    print(f"max |engine - transformers float32| log-prob, bfloat16: {gaps}")
    assert gaps["flash"] <= max(2 * gaps["torch_native"], 0.05)


def _same_tokens_logprob_gap(results: list[dict], reference: list[dict]) -> float:
    """Asserts every request got the same tokens; returns the largest log-prob difference."""
    worst = 0.0
    for a, b in zip(results, reference, strict=True):
        assert a["output_ids"] == b["output_ids"]
        got = torch.tensor([x[0] for x in a["meta_info"]["output_token_logprobs"]])
        want = torch.tensor([x[0] for x in b["meta_info"]["output_token_logprobs"]])
        worst = max(worst, (got - want).abs().max().item())
    return worst


def test_release_memory_gives_the_gpu_back(tiny_model, tmp_path):
    """After /release_memory_occupation the engine holds next to nothing on the GPU: weights, KV
    cache, CUDA graphs and cuBLAS workspaces are gone, and the caching allocator is emptied."""
    import json
    import urllib.request

    with start_engine(tiny_model, tmp_path, "--device", "cuda") as eng:
        _seeded_run(eng.url, [([5, 6, 7], 8), ([9, 10], 12)])
        before = _server_state(eng.url)
        req = urllib.request.Request(
            f"{eng.url}/release_memory_occupation",
            data=json.dumps({}).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=60).read()
        after = _server_state(eng.url)
    print(
        "engine GPU memory before release:",
        before["cuda_memory_allocated"],
        before["cuda_memory_reserved"],
        "after:",
        after["cuda_memory_allocated"],
        after["cuda_memory_reserved"],
    )
    assert before["cuda_memory_allocated"] > 1 << 20
    # What may stay: the model's few small non-parameter buffers (rotary inverse frequencies),
    # which no weight push restores, in one small segment of the caching allocator.
    assert after["cuda_memory_allocated"] < 1 << 16 and after["cuda_memory_reserved"] <= 2 << 20
