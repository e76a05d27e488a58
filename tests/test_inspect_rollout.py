"""The rollout inspector on a dump whose contents the test knows."""

from __future__ import annotations

import copy
import json

import pytest

from slime.rollout.dump import save_dump
from slime.tools.inspect_rollout import main


@pytest.fixture
def dump_path(tmp_path, tiny_model, tokenizer):
    samples = []
    for g, (prompt, answers) in enumerate([("1+1=", ["2", "3"]), ("2+2=", ["4", "4"])]):
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        for a in answers:
            resp = [*tokenizer.encode(a, add_special_tokens=False), tokenizer.eos_token_id]
            samples.append(
                {
                    "index": len(samples),
                    "group_index": g,
                    "prompt": prompt,
                    "tokens": prompt_ids + resp,
                    "response": a,
                    "response_length": len(resp),
                    "label": str(2 * (g + 1)),
                    "reward": float(a == str(2 * (g + 1))),
                    "loss_mask": [1] * len(resp),
                    "rollout_log_probs": [-0.5, -0.25][: len(resp)],
                    "status": "completed",
                    "weight_version": "1",
                    "metadata": {},
                }
            )
    meta = {"tokenizer_fingerprint": "f" * 64, "flags": {"hf_checkpoint": tiny_model}}
    return save_dump(str(tmp_path / "r_{rollout_id}.pt"), 7, samples, meta), samples, meta


def test_summary_counts_rewards_lengths_and_log_probs(dump_path, capsys):
    path, _, _ = dump_path
    assert main([path, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["rollout_id"], s["samples"], s["groups"]) == (7, 4, 2)
    assert s["reward"]["mean"] == 0.75 and s["reward"]["counts"] == {"0.0": 1, "1.0": 3}
    assert s["response_length"]["mean"] == 2 and s["status"] == {"completed": 4}
    assert s["weight_versions"] == {"1": 4}
    assert s["rollout_log_probs"]["tokens"] == 8 and s["rollout_log_probs"]["mean"] == -0.375
    assert main([path]) == 0
    assert "4 samples in 2 groups" in capsys.readouterr().out


def test_one_sample_decoded_token_by_token(dump_path, capsys):
    path, _, _ = dump_path
    assert main([path, "--sample", "1", "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert v["response"] == "3" and v["reward"] == 0.0 and v["prompt_tokens"] == 4
    assert [(t["text"], t["log_prob"]) for t in v["response_tokens"]] == [("3", -0.5), ("<|im_end|>", -0.25)]
    assert main([path, "--sample", "1"]) == 0
    assert "'3'" in capsys.readouterr().out


def test_diff_names_the_first_differing_sample_field_and_token(dump_path, tmp_path, capsys):
    path, samples, meta = dump_path
    changed = copy.deepcopy(samples)
    changed[2]["tokens"][-2] = changed[2]["tokens"][-2] + 1
    changed[3]["reward"] = 0.0
    other = save_dump(str(tmp_path / "other_{rollout_id}.pt"), 7, changed, meta)
    assert main([path, "--diff", path]) == 0
    assert "identical" in capsys.readouterr().out
    assert main([path, "--diff", other, "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["differing_samples"] == 2
    assert d["differences"][0]["sample"] == 2 and d["differences"][0]["field"] == "tokens"
    assert d["differences"][0]["first_difference"].startswith("position 4:")
    assert d["differences"][1] == {"sample": 3, "field": "reward", "first_difference": "1.0 != 0.0"}


def test_not_a_dump_exits_2(tmp_path, capsys):
    (tmp_path / "x.pt").write_bytes(b"not a dump")
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "x.pt")])
    assert e.value.code == 2 and "weights_only=True" in capsys.readouterr().err
