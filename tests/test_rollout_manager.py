"""One rollout through a real torch engine: groups, rewards, filtering, over-sampling aborts."""

from __future__ import annotations

import asyncio
import json
import statistics

import pytest

from slime.config.rollout import DataConfig, SamplingConfig
from slime.engines.client import EngineClient
from slime.rollout.builtin_rollout import RolloutGenerator
from slime.rollout.data import PromptDataset
from slime.rollout.rewards import RewardModel
from slime.utils.sample import Status


def keep_even_prompts(args, group):
    return group[0].metadata["prompt_index"] % 2 == 0


def run_rollout(engine_url, tokenizer, path, **kw):
    async def go():
        async with EngineClient(engine_url) as client:
            ds = PromptDataset(DataConfig(path), tokenizer)
            gen = RolloutGenerator(
                ds,
                [client],
                RewardModel("exact", None, False, None),
                SamplingConfig(n_samples_per_prompt=3, max_response_len=kw.pop("max_len", 4)),
                **kw,
            )
            return await gen.generate_rollout(), ds

    return asyncio.run(go())


def test_rollout_groups_rewards_and_versions(engine, tokenizer, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(8)))
    result, ds = run_rollout(engine.url, tokenizer, str(path), rollout_batch_size=4)
    samples = result.samples
    assert len(samples) == 12 and [s.index for s in samples] == list(range(12))
    assert [s.group_index for s in samples] == [g for g in range(4) for _ in range(3)]
    for s in samples:
        assert s.status in (Status.COMPLETED, Status.TRUNCATED)
        assert s.reward in (0.0, 1.0)
        assert (
            len(s.rollout_log_probs) == s.response_length == len(s.tokens) - len(tokenizer.encode(s.prompt))
        )
        assert s.weight_versions and None not in s.weight_versions
    assert {s.metadata["prompt_index"] for s in samples} == {0, 1, 2, 3}
    assert ds.offset == 4


def test_dynamic_sampling_filter_draws_more_prompts(engine, tokenizer, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}*3=", "label": "0"}) + "\n" for i in range(40)))
    # one prompt at a time: 0 kept, 1 filtered, 2 kept
    result, ds = run_rollout(
        engine.url,
        tokenizer,
        str(path),
        rollout_batch_size=2,
        over_sampling_batch_size=1,
        group_filter=keep_even_prompts,
    )
    assert sorted({s.metadata["prompt_index"] for s in result.samples}) == [0, 2]
    assert (result.num_prompts_started, result.num_groups_filtered, result.num_groups_aborted) == (3, 1, 0)
    assert ds.offset == 3


def test_over_sampling_discards_the_surplus(engine, tokenizer, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}*3=", "label": "0"}) + "\n" for i in range(40)))
    result, _ = run_rollout(
        engine.url, tokenizer, str(path), rollout_batch_size=2, over_sampling_batch_size=8, max_len=200
    )
    r = result
    assert len({s.group_index for s in r.samples}) == 2 and r.num_prompts_started == 8
    assert 2 + r.num_groups_filtered + r.num_groups_aborted + r.num_groups_surplus == r.num_prompts_started


class RecordingClient(EngineClient):
    """An engine client that keeps the meta_info of every /generate answer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.metas: list[dict] = []

    async def generate(self, *args, **kwargs):
        out = await super().generate(*args, **kwargs)
        self.metas.append(out["meta_info"])
        return out


def spans_of(sample):
    """name -> (start, end) of each span in the sample's trace (names occur once here)."""
    ends = {e["span_id"]: e for e in sample.trace["events"] if e["type"] == "span_end"}
    return {e["name"]: (e, ends[e["span_id"]]) for e in sample.trace["events"] if e["type"] == "span_start"}


def stats(values):
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "max": max(values),
        "min": min(values),
    }


def test_samples_carry_slimes_traces_and_the_request_metrics_come_from_them(engine, tokenizer, tmp_path):
    from slime.observability.trace_utils import build_sglang_meta_trace_attrs
    from slime.rollout.summary import request_perf_metrics

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(2)))

    async def go():
        async with RecordingClient(engine.url) as client:
            ds = PromptDataset(DataConfig(str(path)), tokenizer)
            sampling = SamplingConfig(n_samples_per_prompt=2, max_response_len=4)
            reward = RewardModel("exact", None, False, None)
            gen = RolloutGenerator(ds, [client], reward, sampling, rollout_batch_size=2)
            return await gen.generate_rollout(), client.metas

    result, metas = asyncio.run(go())
    assert len(result.samples) == len(metas) == 4
    by_id = {m["id"]: m for m in metas}
    for s in result.samples:
        spans = spans_of(s)
        assert set(spans) == {"generate_and_rm_group", "generate_and_rm", "sglang_generate", "reward_model"}
        group, gen_rm = (spans[k][0]["span_id"] for k in ("generate_and_rm_group", "generate_and_rm"))
        assert spans["generate_and_rm_group"][0]["attrs"] == {"group_size": 2}
        assert spans["generate_and_rm"][0]["parent_span_id"] == group
        assert spans["reward_model"][0]["parent_span_id"] == group  # the group is scored at once
        start, end = spans["sglang_generate"]
        assert start["parent_span_id"] == gen_rm and start["attrs"] == {"max_new_tokens": 4}
        meta = by_id[end["attrs"]["sglang_request_id"]]
        assert end["attrs"] == build_sglang_meta_trace_attrs(meta)
        assert {"e2e_latency", "queue_time", "prompt_tokens", "completion_tokens", "cached_tokens"} <= set(
            end["attrs"]
        )
        assert end["attrs"]["completion_tokens"] == s.response_length
    metrics = request_perf_metrics(result.samples)
    expected = {}
    fields = {"request/e2e_latency": "e2e_latency", "request/queue_time": "queue_time"}
    for metric, key in {**fields, "decode/throughput": "decode_throughput"}.items():
        values = [m[key] for m in metas if key in m]
        if values:
            expected.update({f"perf/{metric}/{name}": v for name, v in stats(values).items()})
    assert metrics == pytest.approx(expected) and "perf/request/e2e_latency/median" in metrics


def test_the_producers_rollout_metrics_and_dump_carry_the_traces(engine, tiny_model, tmp_path):
    from slime.ray.cli import parse_args
    from slime.rollout.dump import load_dump
    from slime.rollout.producer import RolloutProducer
    from slime.rollout.summary import request_perf_metrics
    from slime.utils.sample import Sample

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(2)))
    dump = str(tmp_path / "rollout_{rollout_id}.pt")
    flags = {
        "--hf-checkpoint": tiny_model,
        "--prompt-data": str(path),
        "--rollout-batch-size": "2",
        "--n-samples-per-prompt": "2",
        "--rollout-max-response-len": "4",
        "--num-rollout": "1",
        "--rm-type": "exact",
        "--rollout-backend": "torch",
        "--save-debug-rollout-data": dump,
    }
    cfg = parse_args([part for flag in flags.items() for part in flag])
    producer = RolloutProducer(cfg)
    producer.connect([engine.url])
    try:
        rollout = producer.generate(0)
    finally:
        producer.close()
    samples = [Sample.from_dict(d) for d in load_dump(rollout.dump_path)["samples"]]  # weights_only=True
    assert all("sglang_generate" in spans_of(s) for s in samples)
    perf = {k: v for k, v in rollout.metrics.items() if k.startswith("perf/")}
    assert perf == request_perf_metrics(samples)
    assert {
        "perf/request/e2e_latency/mean",
        "perf/request/queue_time/max",
        "perf/decode/throughput/min",
    } <= set(perf)


def test_slimes_plugin_functions_trace_as_slimes_do(engine, tiny_model, tmp_path):
    """slime.rollout.sglang_rollout.generate_and_rm_group > generate_and_rm > sglang_generate,
    reward_model, through the engine at args.sglang_router_ip/port."""
    from slime.ray.cli import parse_args
    from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
    from slime.utils.async_utils import run
    from slime.utils.net import host_port
    from slime.utils.sample import Sample

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    flags = {
        "--hf-checkpoint": tiny_model,
        "--prompt-data": str(path),
        "--rm-type": "exact",
        "--rollout-max-response-len": "4",
        "--rollout-batch-size": "1",
        "--num-rollout": "1",
    }
    args = parse_args([part for flag in flags.items() for part in flag]).args
    args.sglang_router_ip, args.sglang_router_port = host_port(engine.url)
    GenerateState.clear_instances()
    try:
        group = [Sample(index=i, prompt="1+1=", label="2") for i in range(2)]
        run(generate_and_rm_group(args, group, GenerateState(args).sampling_params))
    finally:
        GenerateState.clear_instances()
    for s in group:
        spans = spans_of(s)
        assert set(spans) == {"generate_and_rm_group", "generate_and_rm", "sglang_generate", "reward_model"}
        assert spans["generate_and_rm_group"][0]["attrs"] == {"group_size": 2}
        gen_rm = spans["generate_and_rm"][0]["span_id"]
        assert spans["generate_and_rm"][0]["parent_span_id"] == spans["generate_and_rm_group"][0]["span_id"]
        assert (
            spans["sglang_generate"][0]["parent_span_id"]
            == spans["reward_model"][0]["parent_span_id"]
            == gen_rm
        )
        end_attrs = spans["sglang_generate"][1]["attrs"]
        assert end_attrs["completion_tokens"] == s.response_length and end_attrs["e2e_latency"] > 0


async def custom_generate(args, sample, sampling_params):
    """A user generate function with slime's signature: posts to the engine itself."""
    import aiohttp

    url = f"http://{args.url}/generate"
    body = {"input_ids": sample.tokens, "sampling_params": {**sampling_params, "max_new_tokens": 2}}
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        out = await r.json()
    sample.tokens = sample.tokens + out["output_ids"]
    sample.response, sample.response_length = out["text"], len(out["output_ids"])
    sample.status = Status.COMPLETED
    sample.metadata["custom"] = True
    return sample


def run_generate_fn(engine, tokenizer, tmp_path, generate_fn, **args):
    """One rollout of one prompt ("1+1=", 2 samples) through `generate_fn`, on the module's engine."""
    from types import SimpleNamespace

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")

    async def go():
        async with EngineClient(engine.url) as client:
            gen = RolloutGenerator(
                PromptDataset(DataConfig(str(path)), tokenizer),
                [client],
                RewardModel("exact", None, False, None),
                SamplingConfig(n_samples_per_prompt=2),
                rollout_batch_size=1,
                args=SimpleNamespace(url=engine.url.removeprefix("http://"), **args),
                generate_fn=generate_fn,
            )
            return await gen.generate_rollout()

    return asyncio.run(go())


def test_custom_generate_function(engine, tokenizer, tmp_path):
    result = run_generate_fn(engine, tokenizer, tmp_path, custom_generate)
    assert len(result.samples) == 2
    for s in result.samples:
        assert s.metadata["custom"] and s.response_length == 2 and s.reward in (0.0, 1.0)
        assert s.tokens[:4] == tokenizer.encode("1+1=", add_special_tokens=False)


async def fanning_generate(args, sample, sampling_params):
    """slime's fan-out: one execution returns two samples with its rollout_id (or, with
    args.bad, a list that forgets it)."""
    import copy

    first = await custom_generate(args, sample, sampling_params)
    second = copy.deepcopy(first)
    for k, s in enumerate((first, second)):
        s.rollout_id = {"unset": None, "split": k}.get(args.bad, 0)  # slime's examples use 0 or sample.index
    return [first, second]


async def constant_id_generate(args, sample, sampling_params):
    """One sample per call with rollout_id 0 on each (as some plugins write it)."""
    out = await custom_generate(args, sample, sampling_params)
    out.rollout_id = 0
    return out


def test_single_samples_with_one_constant_rollout_id_stay_separate_executions(engine, tokenizer, tmp_path):
    samples = run_generate_fn(engine, tokenizer, tmp_path, constant_id_generate).samples
    assert [s.rollout_id for s in samples] == [s.index for s in samples] == [0, 1]


@pytest.mark.parametrize("bad", [None, "unset", "split"])
def test_a_generate_function_may_fan_one_sample_out_into_several(engine, tokenizer, tmp_path, bad):
    if bad:
        error = TypeError if bad == "unset" else ValueError
        with pytest.raises(
            error, match="all set rollout_id" if bad == "unset" else "siblings must share one"
        ):
            run_generate_fn(engine, tokenizer, tmp_path, fanning_generate, bad=bad)
        return
    samples = run_generate_fn(engine, tokenizer, tmp_path, fanning_generate, bad=bad).samples
    assert len(samples) == 4 and len({s.group_index for s in samples}) == 1  # two executions x two
    # Both executions said rollout_id 0: each keeps its own, the index of its first sample.
    assert [s.rollout_id for s in samples] == [0, 0, 2, 2] and [s.index for s in samples] == [0, 1, 2, 3]


def scripted_rollout(args, rollout_id, data_source, evaluation=False):
    """A --rollout-function-path function that needs no engine: answers "2" to every prompt;
    it scores the first sample of each group itself and leaves the rest to --rm-type."""
    from slime.utils.sample import Sample

    groups = data_source.get_samples(2)
    for group in groups:
        for k, s in enumerate(group):
            assert isinstance(s, Sample) and s.tokens  # prompt ids, as slime's data source gives
            s.tokens = [*s.tokens, args.answer_token]
            s.response, s.response_length = "2", 1
            s.status = Status.COMPLETED
            s.rollout_log_probs = [-0.5]
            s.reward = 0.25 if k == 0 else None
    if getattr(args, "wrap", False):  # slime's typed output, with metrics of its own
        from slime.rollout.base_types import RolloutFnTrainOutput

        return RolloutFnTrainOutput(samples=groups, metrics={"rollout/scripted": 7.0})
    return [s for g in groups for s in g] if args.flat else groups


def test_rollout_function_path_without_engines(tiny_model, tokenizer, tmp_path):
    from slime.ray.cli import parse_args
    from slime.rollout.producer import RolloutProducer

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": "2"}) + "\n" for i in range(5)))
    from slime.rollout.dump import load_dump

    for flat in (False, True):
        dump = str(tmp_path / f"flat{flat}" / "rollout_{rollout_id}.pt")
        cfg = parse_args(
            [
                "--hf-checkpoint",
                tiny_model,
                "--prompt-data",
                str(path),
                "--rollout-batch-size",
                "2",
                "--n-samples-per-prompt",
                "3",
                "--num-rollout",
                "2",
                "--rm-type",
                "exact",
                "--rollout-function-path",
                "tests.test_rollout_manager.scripted_rollout",
                "--save-debug-rollout-data",
                dump,
            ]
        )
        cfg.args.answer_token = tokenizer.convert_tokens_to_ids("2")
        cfg.args.flat = flat
        manager = RolloutProducer(cfg)
        rollout = manager.generate(0, weight_version=3)
        # The driver gets a summary; the samples are in the dump the manager wrote.
        assert rollout.dump_path == dump.format(rollout_id=0) and rollout.num_samples == 6
        assert rollout.metrics["rollout/reward_mean"] == 0.75 and rollout.data_state == {
            "epoch": 0,
            "offset": 2,
        }
        saved = load_dump(rollout.dump_path)
        samples = saved["samples"]
        assert saved["meta"]["weight_version"] == 3
        assert [s["group_index"] for s in samples] == [0, 0, 0, 1, 1, 1]
        assert [s["index"] for s in samples] == list(range(6))
        assert [s["reward"] for s in samples] == [
            0.25,
            1.0,
            1.0,
            0.25,
            1.0,
            1.0,
        ]  # the function's, then exact's
        assert all(s["rollout_log_probs"] == [-0.5] and s["response_length"] == 1 for s in samples)
        rollout = manager.generate(1)
        samples = load_dump(rollout.dump_path)["samples"]
        assert [s["metadata"]["prompt_index"] for s in samples[::3]] == [2, 3] and rollout.data_state[
            "offset"
        ] == 4


def wrong_rollout(args, rollout_id, data_source, evaluation=False):
    return {"not": "a list of groups"}


def test_rollout_function_path_errors_name_the_flag(tiny_model, tmp_path):
    import pytest

    from slime.ray.cli import parse_args
    from slime.rollout.producer import RolloutProducer

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    cfg = parse_args(
        [
            "--hf-checkpoint",
            tiny_model,
            "--prompt-data",
            str(path),
            "--rollout-batch-size",
            "1",
            "--num-rollout",
            "1",
            "--rollout-function-path",
            "tests.test_rollout_manager.wrong_rollout",
        ]
    )
    with pytest.raises(TypeError, match="--rollout-function-path"):
        RolloutProducer(cfg).generate(0)


def test_a_rollout_function_returning_slimes_train_output(tiny_model, tokenizer, tmp_path):
    from slime.ray.cli import parse_args
    from slime.rollout.producer import RolloutProducer

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": "2"}) + "\n" for i in range(4)))
    cfg = parse_args(
        [
            "--hf-checkpoint",
            tiny_model,
            "--prompt-data",
            str(path),
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "3",
            "--num-rollout",
            "1",
            "--rm-type",
            "exact",
            "--rollout-function-path",
            "tests.test_rollout_manager.scripted_rollout",
        ]
    )
    cfg.args.answer_token, cfg.args.flat, cfg.args.wrap = tokenizer.convert_tokens_to_ids("2"), False, True
    rollout = RolloutProducer(cfg).generate(0)
    assert rollout.num_samples == 6 and rollout.metrics["rollout/scripted"] == 7.0
    assert rollout.metrics["rollout/reward_mean"] == 0.75


def drop_odd_prompts(args, group):
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput

    keep = group[0].metadata["prompt_index"] % 2 == 0
    return DynamicFilterOutput(
        keep=keep, reason=None if keep else "odd", keep_when_insufficient=args.fallback
    )


def test_dynamic_filter_output_drops_its_groups_and_counts_the_reason(engine, tokenizer, tmp_path):
    from types import SimpleNamespace

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}*3=", "label": "0"}) + "\n" for i in range(40)))
    run = dict(rollout_batch_size=2, over_sampling_batch_size=1, group_filter=drop_odd_prompts)
    result, ds = run_rollout(engine.url, tokenizer, str(path), args=SimpleNamespace(fallback=False), **run)
    # A DynamicFilterOutput(keep=False) is a drop (it is an object, and objects are true in Python).
    assert sorted({s.metadata["prompt_index"] for s in result.samples}) == [0, 2]
    assert result.drop_reasons == {"odd": 1}
    assert result.filter_metrics() == {"rollout/dynamic_filter/drop_odd": 1.0}
    # keep_when_insufficient: one prompt at a time, a rejected group is kept rather than draw another.
    result, ds = run_rollout(engine.url, tokenizer, str(path), args=SimpleNamespace(fallback=True), **run)
    assert sorted({s.metadata["prompt_index"] for s in result.samples}) == [0, 1] and ds.offset == 2
    assert result.drop_reasons == {}


def test_a_filter_returning_something_else_is_refused(engine, tokenizer, tmp_path):
    import pytest

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1*3=", "label": "0"}) + "\n")
    with pytest.raises(TypeError, match="--dynamic-sampling-filter-path must return a DynamicFilterOutput"):
        run_rollout(
            engine.url, tokenizer, str(path), rollout_batch_size=1, group_filter=lambda a, g: {"keep": 0}
        )


def test_the_actor_classes_have_no_coroutine_methods():
    """Ray runs a class with any coroutine method (private ones too) as an async actor: its sync
    methods then share one event loop and wait for each other, so the driver's health calls
    (down_engines) would wait behind a running rollout and a lost engine would never be
    restarted. The check Ray makes, on each class the job turns into an actor."""
    import inspect

    from slime.ray.actors import EngineActor, SGLangEngineActor, TrainRank
    from slime.ray.rollout_manager import RolloutManager

    for cls in (RolloutManager, EngineActor, SGLangEngineActor, TrainRank):
        coroutines = [
            name
            for name, f in inspect.getmembers(cls, inspect.isfunction)
            if inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f)
        ]
        assert not coroutines, (cls.__name__, coroutines)
