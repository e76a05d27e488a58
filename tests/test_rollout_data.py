"""Prompt data, samples and reward functions (no engine)."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap

import pytest
import torch

from slime.config.rollout import DataConfig
from slime.rollout.data import DataError, PromptDataset
from slime.rollout.rewards import RewardModel
from slime.rollout.rm_hub.boxed import last_boxed
from slime.rollout.rm_hub.math_rules import math_reward
from slime.utils.sample import Sample, Status, samples_to_batch


def write_jsonl(path, rows, raw_lines=()):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return str(path)


def test_jsonl_prompts_keys_and_epochs(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"q": f"{i}+1=", "a": str(i + 1), "meta": {"i": i}} for i in range(5)]
    )
    ds = PromptDataset(DataConfig(path, input_key="q", label_key="a", metadata_key="meta"), tokenizer)
    first = ds.next_batch(3)
    assert [p.label for p in first] == ["1", "2", "3"] and first[0].metadata == {"i": 0}
    assert first[1].token_ids == tokenizer.encode("1+1=", add_special_tokens=False)
    second = ds.next_batch(4)  # crosses into epoch 1
    assert [p.index for p in second] == [3, 4, 0, 1] and ds.epoch == 1


def test_shuffle_is_seeded_per_epoch_and_resumable(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}", "label": i} for i in range(10)])
    cfg = DataConfig(path, shuffle=True, seed=3)
    a = PromptDataset(cfg, tokenizer)
    order = [p.index for p in a.next_batch(15)]
    assert sorted(order[:10]) == list(range(10)) and order[:10] != list(range(10))
    b = PromptDataset(cfg, tokenizer)
    b.next_batch(12)
    state = b.state_dict()
    c = PromptDataset(cfg, tokenizer)
    c.load_state_dict(state)
    assert [p.index for p in c.next_batch(3)] == order[12:15]


def test_chat_template_and_length_filter(tmp_path, tokenizer, caplog):
    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "9" * 50, "label": "x"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    ds = PromptDataset(DataConfig(path, apply_chat_template=True, max_prompt_len=30), tokenizer)
    assert len(ds) == 1
    assert ds.prompts[0].text.startswith("<|im_start|>user") and ds.prompts[0].text.endswith("assistant\n")
    assert "dropped 1 of 2 prompts" in caplog.text


def test_tools_go_to_the_chat_template_and_metadata_with_its_kwargs(tmp_path, tokenizer):
    tool = {"type": "function", "function": {"name": "calc", "description": "add", "parameters": {}}}
    rows = [{"prompt": "1+1=", "label": "2", "tools": json.dumps([tool])}, {"prompt": "2+2=", "label": "4"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    seen = []
    real = tokenizer.apply_chat_template

    def spy(messages, **kw):
        seen.append(kw)
        return real(messages, **{k: v for k, v in kw.items() if k != "flavour"})

    tokenizer.apply_chat_template = spy
    try:
        ds = PromptDataset(
            DataConfig(path, apply_chat_template=True, apply_chat_template_kwargs={"flavour": 1}), tokenizer
        )
    finally:
        del tokenizer.apply_chat_template
    assert seen[0]["tools"] == [tool] and seen[1]["tools"] is None and seen[0]["flavour"] == 1
    assert ds.prompts[0].metadata["tools"] == [tool] and "tools" not in ds.prompts[1].metadata
    bad = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "x", "label": "y", "tools": "{oops"}])
    with pytest.raises(DataError, match=r"b.jsonl:1: field 'tools' \(--tool-key\) is not JSON"):
        PromptDataset(DataConfig(bad), tokenizer)


@pytest.mark.parametrize(
    "rows, raw, message",
    [
        ([{"prompt": "a", "label": 1}], ["{not json"], "p.jsonl:2: not valid JSON"),
        (
            [{"prompt": "a", "label": 1}, {"text": "b", "label": 2}],
            [],
            "p.jsonl:2: no field 'prompt' (--input-key)",
        ),
        ([{"prompt": "a"}], [], "p.jsonl:1: no field 'label' (--label-key)"),
        ([{"prompt": [{"role": "user", "content": "x"}], "label": 1}], [], "add --apply-chat-template"),
        ([], ["[1, 2]"], "expected a JSON object"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, tokenizer, rows, raw, message):
    path = write_jsonl(tmp_path / "p.jsonl", rows, raw)
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PromptDataset(DataConfig(path), tokenizer)


def test_missing_file(tmp_path, tokenizer):
    with pytest.raises(DataError, match=r"--prompt-data .* no such file"):
        PromptDataset(DataConfig(str(tmp_path / "nope.jsonl")), tokenizer)


def test_parquet(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "p.parquet")
    pq.write_table(pa.table({"prompt": ["1+2=", "2+2="], "label": ["3", "4"]}), path)
    ds = PromptDataset(DataConfig(path), tokenizer)
    assert [p.label for p in ds.next_batch(2)] == ["3", "4"]


def test_sample_round_trips_plain_dicts(tmp_path):
    s = Sample(
        index=3,
        group_index=1,
        prompt="1+1=",
        tokens=[5, 6, 7],
        response="2",
        response_length=1,
        label="2",
        reward=1.0,
        loss_mask=[1],
        rollout_log_probs=[-0.5],
        status=Status.COMPLETED,
        weight_versions=["4"],
        metadata={"k": [1, 2]},
    )
    path = tmp_path / "s.pt"
    torch.save([s.to_dict()], path)
    loaded = torch.load(path, weights_only=True)
    assert Sample.from_dict(loaded[0]) == s


def test_samples_to_batch_and_dict_rewards():
    samples = [
        Sample(
            index=i,
            group_index=i // 2,
            tokens=[1, 2, 3],
            response_length=2,
            reward={"acc": float(i), "fmt": 1.0},
            rollout_log_probs=[-1.0, -2.0],
        )
        for i in range(4)
    ]
    with pytest.raises(KeyError, match="--reward-key"):
        samples_to_batch(samples)
    batch = samples_to_batch(samples, reward_key="acc")
    assert batch.rewards == [0.0, 1.0, 2.0, 3.0] and batch.group_indices == [0, 0, 1, 1]
    assert batch.loss_masks == [[1, 1]] * 4 and batch.rollout_log_probs == [[-1.0, -2.0]] * 4
    samples[1].rollout_log_probs = None
    assert samples_to_batch(samples, reward_key="acc").rollout_log_probs is None


def test_math_reward():
    # slime's `math`: the last \boxed{} answer only, compared as MATH answers (1 or 0).
    assert last_boxed(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert math_reward(r"The answer is \boxed{42}.", "42") == 1
    assert math_reward(r"\boxed{1/2}", "0.5") == 1
    assert math_reward(r"\boxed{41}", "42") == 0
    assert math_reward("I think 3, no wait, 4", 4) == 0  # no \boxed{} answer
    assert math_reward("no number", "1") == 0
    samples = [Sample(response=r"\boxed{\dfrac{1}{2}}", label="0.5"), Sample(response="0.5", label="0.5")]
    asyncio.run(RewardModel("math", None, False, args=None).score_group(samples))
    assert [s.reward for s in samples] == [1, 0]


def test_custom_reward_functions(tmp_path, monkeypatch):
    (tmp_path / "my_rm.py").write_text(
        textwrap.dedent(
            """
            async def score(args, sample):
                return {"acc": float(sample.response == sample.label), "len": len(sample.response)}
            def group(args, samples):
                return [float(i) for i, _ in enumerate(samples)]
            def broken(args, sample):
                raise RuntimeError("reward exploded")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    samples = [Sample(response="2", label="2"), Sample(response="3", label="2")]
    asyncio.run(RewardModel(None, "my_rm.score", False, args=None).score_group(samples))
    assert samples[0].reward == {"acc": 1.0, "len": 1} and samples[1].reward["acc"] == 0.0
    asyncio.run(RewardModel(None, "my_rm.group", True, args=None).score_group(samples))
    assert [s.reward for s in samples] == [0.0, 1.0]
    with pytest.raises(RuntimeError, match="reward exploded"):
        asyncio.run(RewardModel(None, "my_rm.broken", False, args=None).score_group(samples))
    with pytest.raises(ValueError, match=r"--custom-rm-path 'my_rm\.nope'"):
        RewardModel(None, "my_rm.nope", False, args=None)
    with pytest.raises(ValueError, match="--rm-type 'bogus'"):
        RewardModel("bogus", None, False, args=None)
    sys.modules.pop("my_rm", None)
