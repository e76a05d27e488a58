"""One rollout through a real torch engine: groups, rewards, filtering, over-sampling aborts."""

from __future__ import annotations

import asyncio
import json

from slime.config.rollout import DataConfig, SamplingConfig
from slime.engines.client import EngineClient
from slime.rollout.data import PromptDataset
from slime.rollout.manager import RolloutGenerator
from slime.rollout.rewards import RewardModel
from slime.rollout.sample import Status


def keep_even_prompts(args, group):
    return group[0].metadata["prompt_index"] % 2 == 0


def run_rollout(engine_url, tokenizer, path, **kw):
    async def go():
        async with EngineClient(engine_url) as client:
            ds = PromptDataset(DataConfig(path), tokenizer)
            gen = RolloutGenerator(
                ds, [client], RewardModel("exact", None, False, None),
                SamplingConfig(n_samples_per_prompt=3, max_response_len=kw.pop("max_len", 4)), **kw,
            )  # fmt: skip
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
        assert s.weight_version is not None
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


def test_custom_generate_function(engine, tokenizer, tmp_path):
    from types import SimpleNamespace

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")

    async def go():
        async with EngineClient(engine.url) as client:
            gen = RolloutGenerator(
                PromptDataset(DataConfig(str(path)), tokenizer), [client], RewardModel("exact", None, False, None),
                SamplingConfig(n_samples_per_prompt=2), rollout_batch_size=1,
                args=SimpleNamespace(url=engine.url.removeprefix("http://")), generate_fn=custom_generate,
            )  # fmt: skip
            return await gen.generate_rollout()

    result = asyncio.run(go())
    assert len(result.samples) == 2
    for s in result.samples:
        assert s.metadata["custom"] and s.response_length == 2 and s.reward in (0.0, 1.0)
        assert s.tokens[:4] == tokenizer.encode("1+1=", add_special_tokens=False)
