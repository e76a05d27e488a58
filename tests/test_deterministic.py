"""--deterministic-mode: batch-invariant engines, seeded samples, and whole runs that repeat bit
for bit (real engine servers, real Ray jobs)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch

from slime.engines.client import EngineClient
from slime.utils.seed import enable_deterministic, sample_seed
from tests.conftest import start_engine
from tests.test_loop_e2e import prompts, run_job  # noqa: F401 - prompts is a fixture


async def _generate(client, ids, seed, n):
    out = await client.generate(
        input_ids=ids,
        sampling_params={"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True, "sampling_seed": seed},
        return_logprob=True,
    )
    return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]]


def test_a_seeded_request_gets_the_same_bits_alone_and_in_a_crowd(tiny_model, tmp_path):
    rng = random.Random(0)
    target = [rng.randrange(4, 100) for _ in range(17)]
    others = [[rng.randrange(4, 100) for _ in range(rng.randint(3, 60))] for _ in range(15)]
    proc = start_engine(tiny_model, tmp_path, "--enable-deterministic-inference")
    try:

        async def scenario():
            async with EngineClient(proc.url) as c:
                info = await c.get_server_info()
                alone = await _generate(c, target, 7, 24)
                crowd = await asyncio.gather(
                    *[_generate(c, o, i, rng.randint(5, 40)) for i, o in enumerate(others[:7])],
                    _generate(c, target, 7, 24),
                    *[_generate(c, o, i, 30) for i, o in enumerate(others[7:])],
                )
                return info, alone, crowd[7]

        info, alone, in_crowd = asyncio.run(scenario())
    finally:
        proc.stop()
    assert info["enable_deterministic_inference"] is True
    assert alone[0] == in_crowd[0]
    assert alone[1] == in_crowd[1]  # bitwise: the other rows change nothing


def test_sample_seeds_name_their_sample():
    seeds = {
        sample_seed(1234, kind, r, draw, k)
        for kind in ("rollout", "eval")
        for r in range(3)
        for draw in range(4)
        for k in range(4)
    }
    assert len(seeds) == 2 * 3 * 4 * 4 and all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(1234, "rollout", 0, 1, 2) == sample_seed(1234, "rollout", 0, 1, 2)
    assert sample_seed(1234, "rollout", 0, 1, 2) != sample_seed(1235, "rollout", 0, 1, 2)


def test_enable_deterministic_seeds_and_turns_on_deterministic_kernels():
    try:
        enable_deterministic(5)
        a = (random.random(), torch.rand(3))
        assert torch.are_deterministic_algorithms_enabled()
        enable_deterministic(5)
        b = (random.random(), torch.rand(3))
        assert a[0] == b[0] and torch.equal(a[1], b[1])
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.e2e
@pytest.mark.slow  # two whole jobs (~60 s); the seeded engine requests above stay in the default run
def test_two_deterministic_runs_are_identical(tiny_model, prompts, tmp_path):
    """train_async.py on two engines with over-sampling, sampled at temperature 1: the rollouts,
    rewards, losses and grad norms of two runs are the same bits."""
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        out.mkdir()
        proc = run_job(
            "train_async.py",
            tiny_model,
            prompts,
            out,
            "--rm-type",
            "exact",
            "--deterministic-mode",
            "--rollout-num-gpus",
            "2",
            "--over-sampling-batch-size",
            "6",
            "--rollout-max-response-len",
            "8",
            "--lr",
            "1e-3",
            "--num-rollout",
            "3",
            "--save-debug-rollout-data",
            str(out / "r_{rollout_id}.pt"),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
        # What the run computed, not how long it took: time/* and the perf/* throughputs and
        # request latencies, and each sample's trace (when things happened), differ from run to run.
        metrics = [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in records]
        dumps = [
            [
                {k: v for k, v in s.items() if k != "trace"}
                for s in torch.load(out / f"r_{i}.pt", weights_only=True)["samples"]
            ]
            for i in range(3)
        ]
        runs.append((metrics, dumps))
    (metrics_a, dumps_a), (metrics_b, dumps_b) = runs
    assert len(metrics_a) == 3 and all("train/grad_norm" in r for r in metrics_a)
    assert dumps_a == dumps_b  # tokens, rewards, engine log-probs, groups
    assert metrics_a == metrics_b
    assert len({tuple(s["tokens"]) for d in dumps_a for s in d}) > 3  # sampled, not one greedy answer
