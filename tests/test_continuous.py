"""The continuous schedule's pieces against a real torch engine: per-token weight versions across
a push (each pause mode), partial rollouts continued as new requests, and the rollout manager's
continuous pool (lag bound, requeue, every prompt once per epoch, resume state)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from slime.engines.client import EngineClient
from slime.rollout.default_generate import apply_response, continue_sample
from slime.utils.sample import Sample, Status
from tests.conftest import start_engine

GREEDY = {"temperature": 0.0, "max_new_tokens": 120, "ignore_eos": True}


@pytest.fixture(scope="module")
def own_engine(tiny_model, tmp_path_factory):
    """An engine of this module's own: its weight version changes here."""
    proc = start_engine(tiny_model, tmp_path_factory.mktemp("engine-logs"))
    yield proc
    assert proc.stop() in (0, -15)


async def _wait_tokens(client: EngineClient, at_least: int) -> None:
    while True:
        info = await client.get_server_info()
        if info["internal_states"][0]["num_generated_tokens"] >= at_least:
            return
        await asyncio.sleep(0.002)


async def _push_during(client: EngineClient, model: str, version: str, mode: str, prompt: list[int]):
    """Start a greedy request, and push (the same weights, a new version) while it runs."""
    before = (await client.get_server_info())["internal_states"][0]["num_generated_tokens"]
    request = asyncio.ensure_future(
        client.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True)
    )
    await _wait_tokens(client, before + 10)
    await client.pause_generation(mode)
    with contextlib.suppress(Exception):  # in_place keeps the request's KV cache: the flush is refused
        await client.flush_cache()
    await client.update_weights_from_disk(model, weight_version=version)
    await client.continue_generation()
    return await request


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_request_spanning_a_push_reports_the_weights_of_every_token(
    own_engine, tiny_model, tokenizer, mode
):
    prompt = tokenizer.encode("count: 1 2 3")

    async def go():
        async with EngineClient(own_engine.url) as c:
            baseline = await c.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True)
            old = str(baseline["meta_info"]["weight_version"])
            out = await _push_during(c, tiny_model, f"{mode}-1", mode, prompt)
            return baseline, old, out

    baseline, old, out = asyncio.run(go())
    spans = out["meta_info"]["weight_version_spans"]
    assert [v for v, _ in spans] == [old, f"{mode}-1"], spans
    assert all(n > 0 for _, n in spans) and sum(n for _, n in spans) == GREEDY["max_new_tokens"]
    assert out["meta_info"]["weight_version"] == f"{mode}-1"
    # The same weights: the tokens across the push are the ones a request without a push gets.
    assert out["output_ids"] == baseline["output_ids"]
    lp = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    ref = [x[0] for x in baseline["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(lp, ref)) < 1e-4
    sample = apply_response(Sample(), prompt, out)
    assert sample.weight_versions == [old, f"{mode}-1"]
    versions = sample.token_weight_versions()
    assert versions[: spans[0][1]] == [old] * spans[0][1] and versions[-1] == f"{mode}-1"


def test_an_aborted_request_is_continued_on_the_new_weights(own_engine, tiny_model, tokenizer):
    prompt = tokenizer.encode("abc")

    async def go():
        async with EngineClient(own_engine.url) as c:
            baseline = await c.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True)
            out = await _push_during(c, tiny_model, "abort-1", "abort", prompt)
            sample = apply_response(Sample(), prompt, out)
            assert sample.status == Status.ABORTED and 0 < sample.response_length < GREEDY["max_new_tokens"]
            head = sample.response_length
            await continue_sample(c, sample, GREEDY)
            return baseline, sample, head

    baseline, sample, head = asyncio.run(go())
    assert sample.status == Status.TRUNCATED
    assert sample.tokens == prompt + baseline["output_ids"]  # prompt + the tokens across the push
    assert sample.response_length == GREEDY["max_new_tokens"] == len(sample.rollout_log_probs)
    ref = [x[0] for x in baseline["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(sample.rollout_log_probs, ref)) < 1e-4
    versions = sample.token_weight_versions()
    assert versions[head:] == ["abort-1"] * (GREEDY["max_new_tokens"] - head)
    assert versions[0] != "abort-1" and sample.weight_versions[-1] == "abort-1"


def _prompts(tmp_path, n):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(n))
    )
    return str(path)


def _manager(tiny_model, url, tmp_path, *extra, schedule=("--fully-async",)):
    from slime.ray.cli import parse_args
    from slime.rollout.producer import RolloutProducer

    cfg = parse_args(
        [
            "--hf-checkpoint",
            tiny_model,
            "--prompt-data",
            _prompts(tmp_path, 12),
            "--input-key",
            "prompt",
            "--label-key",
            "label",
            "--rm-type",
            "exact",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--rollout-max-response-len",
            "6",
            "--num-rollout",
            "6",
            "--global-batch-size",
            "4",
            *schedule,
            "--rollout-backend",
            "torch",
            "--train-backend",
            "fsdp",
            *extra,
        ]
    )
    m = RolloutProducer(cfg)
    m.connect([url])
    return m


def test_the_pool_with_lag_zero_is_the_synchronous_loop(own_engine, tiny_model, tmp_path):
    m = _manager(tiny_model, own_engine.url, tmp_path, "--max-policy-version-lag", "0")
    try:
        for k in range(6):  # 6 rollouts x 2 groups: one epoch of the 12 prompts
            r = m.take(k, k)
            assert r.metrics["rollout/policy_lag_max"] == 0 and r.metrics["rollout/in_flight_groups"] <= 2
            assert r.num_samples == 4
            # Lag 0: nothing is admitted before the next version arrives (nothing in flight at a push).
            assert not m.pool.flights and not m.pool.done
            assert r.data_state == {"epoch": 0, "offset": 2 * (k + 1)}
        assert m.pool.draws == 12
    finally:
        m.close()


# ---- the pool's rules, with a stand-in for the group generator (timing under the test's control) ----


class FakeGen:
    """Makes a group; its tokens carry the engines' version when it started. `slow_once`: prompt
    indices whose first generation lasts until `gate` opens (a long-tail response)."""

    args = None

    def __init__(self, pool_version, slow_once=()):
        self.clients: list = []
        self.version = pool_version
        self.slow = set(slow_once)
        self.gate = asyncio.Event()

    def live_clients(self):
        return []

    async def group(self, prompt, draw, partial=None):
        v = str(self.version())
        if prompt.index in self.slow:
            self.slow.discard(prompt.index)
            await self.gate.wait()
        await asyncio.sleep(0.001)
        return [
            Sample(
                response_length=3,
                loss_mask=[1, 1, 1],
                weight_version_spans=[[v, 3]],
                reward=1.0,
                metadata={"prompt_index": prompt.index},
            )
            for _ in range(2)
        ]


class CountingDataset:
    def __init__(self, n):
        from slime.rollout.data import Prompt

        self.prompts = [Prompt(index=i, prompt=str(i), text=str(i), token_ids=[1]) for i in range(n)]
        self.drawn: list[int] = []
        self.i = 0

    def next_batch(self, k):
        out = [self.prompts[(self.i + j) % len(self.prompts)] for j in range(k)]
        self.i += k
        self.drawn += [p.index for p in out]
        return out


def _run_pool(action, steps=12, lag=1):
    from collections import Counter

    from slime.config.records import AsyncConfig
    from slime.rollout.continuous import ContinuousPool

    async def go():
        ds = CountingDataset(12)
        holder = {}
        gen = FakeGen(lambda: holder["pool"].version, slow_once={0})
        pool = ContinuousPool(gen, ds, AsyncConfig(True, lag, action), 2, 16, 0)
        holder["pool"] = pool
        trained, metrics = [], []
        for k in range(steps):
            pool.set_version(k)
            taken = await pool.take(k)
            if k == 4:
                gen.gate.set()  # the long group finishes now, its tokens 4 versions old
            trained += [g[0].metadata["prompt_index"] for g in taken.groups]
            metrics.append(taken.metrics)
        pending = [p.index for p in pool.pending_prompts()]
        await pool.close()
        return Counter(trained), Counter(pending), Counter(ds.drawn), metrics

    return asyncio.run(go())


def test_a_group_beyond_the_lag_bound_is_requeued_and_every_prompt_is_trained_once_per_draw():
    trained, pending, drawn, metrics = _run_pool("requeue")
    assert all(m["rollout/policy_lag_max"] <= 1 for m in metrics)
    assert sum(m["rollout/stale_groups_requeued"] for m in metrics) >= 1
    # Every prompt drawn is trained once or still pending (returned to the data on a checkpoint).
    assert trained + pending == drawn and max(trained.values()) <= max(drawn.values())
    assert trained[0] >= 1  # the slow prompt came back and was trained


def test_a_group_beyond_the_lag_bound_can_be_dropped():
    trained, pending, drawn, metrics = _run_pool("drop")
    assert all(m["rollout/policy_lag_max"] <= 1 for m in metrics)
    dropped = sum(m["rollout/stale_groups_dropped"] for m in metrics)
    assert dropped >= 1
    assert sum((drawn - trained - pending).values()) == dropped


def test_the_lag_counts_the_trained_tokens_only():
    from slime.config.records import AsyncConfig
    from slime.rollout.continuous import ContinuousPool, Flight
    from slime.rollout.data import Prompt

    pool = ContinuousPool(FakeGen(lambda: 0), CountingDataset(1), AsyncConfig(True, 1), 1, 1, 0)
    prompt = Prompt(index=0, prompt="", text="", token_ids=[1])

    def lag(s):  # a finished group is measured once: a new one each time
        return pool.lag(Flight(prompt, 0, admitted=0), [s], 3)

    s = Sample(response_length=6, loss_mask=[1] * 6, weight_version_spans=[["0", 3], ["2", 3]])
    assert lag(s) == 3
    s.loss_mask = [0, 0, 0, 1, 1, 1]  # --mask-offpolicy-in-partial-rollout: version 0 is out of the loss
    assert lag(s) == 1
    pool.exact_versions = False  # SGLang: no per-token versions, as old as the admission
    assert lag(s) == 3
    s.weight_version_spans = [["default", 6]]  # an engine's name before the first push: unknown
    pool.exact_versions = True
    assert lag(s) == 3


def test_a_checkpoint_returns_the_prompts_in_flight_to_the_data(tiny_model, tokenizer, tmp_path):
    from slime.config.rollout import DataConfig
    from slime.rollout.data import PromptDataset

    ds = PromptDataset(DataConfig(_prompts(tmp_path, 12)), tokenizer)
    drawn = ds.next_batch(5)
    state = ds.state_dict(pending=drawn[3:])  # prompts 3 and 4 were in flight
    assert state == {"epoch": 0, "offset": 5, "returned": [drawn[3].index, drawn[4].index]}
    resumed = PromptDataset(DataConfig(_prompts(tmp_path, 12)), tokenizer)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [p.index for p in resumed.next_batch(3)] == [drawn[3].index, drawn[4].index, 5]


async def short_even_prompts(args, sample, sampling_params):
    """A generate function (slime's signature): even prompts answer in 12 tokens, odd ones in 160,
    so the odd groups are still generating when a rollout has kept 2 even ones."""
    from slime.rollout.sglang_rollout import generate

    budget = 12 if sample.metadata["prompt_index"] % 2 == 0 else 160
    return await generate(args, sample, dict(sampling_params, max_new_tokens=budget, ignore_eos=True))


def test_partial_rollout_continues_the_groups_over_sampling_cut_off(own_engine, tiny_model, tmp_path):
    """--partial-rollout in the synchronous and one-step-off schedules: the groups a rollout's
    over-sampling cuts off keep their tokens and log-probs and are continued first by the next
    rollout; with --mask-offpolicy-in-partial-rollout their earlier tokens leave the loss; a
    checkpoint in between returns their prompts to the data."""
    import torch

    dumps = str(tmp_path / "r_{rollout_id}.pt")
    m = _manager(
        tiny_model,
        own_engine.url,
        tmp_path,
        "--partial-rollout",
        "--mask-offpolicy-in-partial-rollout",
        "--over-sampling-batch-size",
        "6",
        "--rollout-max-response-len",
        "160",
        "--custom-generate-function-path",
        "tests.test_continuous.short_even_prompts",
        "--save-debug-rollout-data",
        dumps,
        schedule=(),
    )
    try:
        r0 = m.generate(0, 0)
        cut = {
            p.index: [(list(s.tokens), list(s.rollout_log_probs or []), s.status) for s in g]
            for p, g in m.carried
        }
        assert r0.metrics["rollout/partial_groups_carried"] == len(cut) == 4  # 6 started, 2 kept
        # The odd groups were cut off with tokens; one of the even ones had finished, or nearly.
        assert {1, 3, 5} < set(cut)
        assert all(status == Status.ABORTED and lp for i in (1, 3, 5) for _, lp, status in cut[i])
        # A checkpoint now: the cut-off prompts are drawn again first by a resumed run.
        assert r0.data_state == {"epoch": 0, "offset": 6, "returned": list(cut)}
        r1 = m.generate(1, 1)
        assert r1.metrics["rollout/partial_groups_continued"] == 4
        assert r1.data_state["offset"] == 6  # the 4 continued groups were enough: nothing new drawn
        samples = torch.load(dumps.format(rollout_id=1), weights_only=True)["samples"]
        assert len(samples) == 4 and {s["metadata"]["prompt_index"] for s in samples} <= set(cut)
        assert all(s["status"] in ("completed", "truncated") for s in samples)
        # The 2 groups rollout 1 kept, and the 2 it cut off again: all 4 went on from rollout 0's tokens.
        assert r1.metrics["rollout/partial_groups_carried"] == len(m.carried) == 2
        again = [dict(s.to_dict(), index=k) for _, g in m.carried for k, s in enumerate(g)]
        continued = 0
        for s in samples + again:
            tokens, log_probs, status = cut[s["metadata"]["prompt_index"]][s["index"] % 2]
            n = len(log_probs)
            assert s["tokens"][: len(tokens)] == tokens and s["rollout_log_probs"][:n] == log_probs
            assert len(s["rollout_log_probs"]) == s["response_length"] == len(s["loss_mask"])
            if status == Status.ABORTED and n:
                continued += 1
                assert s["loss_mask"][:n] == [0] * n and s["metadata"]["start_rollout_id"] == 0
                assert s["loss_mask"][n:] == [1] * (s["response_length"] - n)
            else:  # no earlier tokens, or finished before the cut (then kept as it was)
                assert s["loss_mask"] == [1] * s["response_length"]
                assert status == Status.ABORTED or s["tokens"] == tokens
        assert continued > 0
    finally:
        m.close()


def test_partial_rollout_is_refused_with_deterministic_mode(tmp_path, capsys):
    from slime.ray.cli import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(
            [
                "--hf-checkpoint",
                "/m",
                "--prompt-data",
                _prompts(tmp_path, 2),
                "--rollout-batch-size",
                "2",
                "--num-rollout",
                "1",
                "--rm-type",
                "exact",
                "--partial-rollout",
                "--deterministic-mode",
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--partial-rollout" in err and "--deterministic-mode" in err, err


def _group(index, version, n=2):
    return [
        Sample(
            response_length=3,
            loss_mask=[1, 1, 1],
            weight_version_spans=[[str(version), 3]],
            reward=1.0,
            metadata={"prompt_index": index},
        )
        for _ in range(n)
    ]


def test_the_oldest_finished_group_is_taken_first():
    """A long response finishes after groups admitted later: it is trained first, before it goes
    stale behind them (taken in finish order, it would wait a step and exceed the bound)."""
    from slime.config.records import AsyncConfig
    from slime.rollout.continuous import ContinuousPool, Flight

    async def go():
        ds = CountingDataset(12)
        pool = ContinuousPool(FakeGen(lambda: 0), ds, AsyncConfig(True, 1, "requeue"), 1, 16, 0)
        pool.done = [
            (Flight(p, k, v), _group(p.index, v)) for k, (p, v) in enumerate(zip(ds.prompts, [1, 0, 1]))
        ]
        pool.set_version(1)
        order = [(await pool.take(1)).groups[0][0].metadata["prompt_index"] for _ in range(2)]
        await pool.close()
        return order

    assert asyncio.run(go()) == [1, 0]  # lag 1 first, then the first finished of the lag-0 ones


def test_a_prompt_that_goes_stale_every_time_is_dropped_after_three_requeues(caplog):
    """Requeued forever, prompts whose responses always take longer than the bound would fill the
    admission slots and stop training. Each is requeued 3 times, then dropped with a warning
    naming the flag; the other prompts train every step."""
    from slime.config.records import AsyncConfig
    from slime.rollout.continuous import ContinuousPool

    class AlwaysLate(FakeGen):
        async def group(self, prompt, draw, partial=None):
            await asyncio.sleep(0.001)
            return _group(prompt.index, self.version() - (5 if prompt.index == 0 else 0))

    async def go():
        ds = CountingDataset(4)
        holder = {}
        pool = ContinuousPool(
            AlwaysLate(lambda: holder["pool"].version), ds, AsyncConfig(True, 1, "requeue"), 2, 16, 0
        )
        holder["pool"] = pool
        steps = []
        for k in range(8):
            pool.set_version(k)
            steps.append(await asyncio.wait_for(pool.take(k), 30))
        await pool.close()
        return steps, ds.drawn

    with caplog.at_level("WARNING"):
        steps, drawn = asyncio.run(go())
    trained = [g[0].metadata["prompt_index"] for t in steps for g in t.groups]
    assert len(trained) == 16 and 0 not in trained
    given_up = steps[-1].metrics["rollout/stale_prompts_given_up"]
    requeued = sum(t.metrics["rollout/stale_groups_requeued"] for t in steps)
    dropped = sum(t.metrics["rollout/stale_groups_dropped"] for t in steps)
    assert given_up == dropped >= 1 and requeued >= 3 * dropped
    assert drawn.count(0) >= given_up  # each draw of prompt 0 is requeued 3 times at most
    assert "prompt 0 went stale 4 times in a row" in caplog.text and "--max-policy-version-lag" in caplog.text
