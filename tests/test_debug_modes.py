"""The decoupled debug modes, started as users start them: rollout-only with dumps, then
train-only replaying them on another layout (real Ray, real engines, real gloo ranks)."""

from __future__ import annotations

import json

import pytest
import torch

from slime.rollout.dump import tokenizer_fingerprint
from tests.test_loop_e2e import prompts, run_job  # noqa: F401 - prompts is a fixture

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def dumps(tiny_model, prompts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollout-only")
    template = str(tmp / "dumps" / "rollout_{rollout_id}.pt")
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp,
        "--rm-type",
        "exact",
        "--debug-rollout-only",
        "--save-debug-rollout-data",
        template,
        "--eval-interval",
        "2",
        "--eval-prompt-data",
        prompts,
        "--save-debug-eval-data",
        str(tmp / "dumps" / "eval_{rollout_id}.pt"),
        "--rollout-temperature",
        "0",
        "--global-batch-size",  # a train flag that does not fit: not validated in this mode
        "3",
    )
    return tmp, template, proc


def test_rollout_only_starts_no_trainer_and_saves_every_rollout(dumps, tokenizer):
    tmp, template, proc = dumps
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mode: rollout only (no trainer)" in proc.stderr
    assert "TrainRank" not in proc.stderr and "train rank 0" not in proc.stderr
    assert sorted(p.name for p in (tmp / "dumps").iterdir()) == [
        "eval_-1.pt",
        "eval_1.pt",
        "rollout_0.pt",
        "rollout_1.pt",
    ]
    for rollout_id in (0, 1):
        dump = torch.load(template.format(rollout_id=rollout_id), weights_only=True)
        assert dump["rollout_id"] == rollout_id and len(dump["samples"]) == 8
        assert dump["meta"]["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer)
        assert dump["meta"]["flags"]["n_samples_per_prompt"] == 2 and not dump["meta"]["evaluation"]
        assert all(s["reward"] in (0.0, 1.0) and s["weight_versions"] == ["0"] for s in dump["samples"])
    assert torch.load(tmp / "dumps" / "eval_1.pt", weights_only=True)["meta"]["evaluation"]
    records = [json.loads(line) for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["rollout_id"] >= 0]
    assert [r["rollout_id"] for r in steps] == [0, 1]
    assert all("rollout/reward_mean" in r and "rollout/accuracy" in r for r in steps)  # logged in this mode
    assert not any(k.startswith("train/") for r in steps for k in r)


def test_train_only_replays_the_dumps_on_two_ranks(dumps, tiny_model, prompts, tmp_path):
    _, template, _ = dumps
    train_template = str(tmp_path / "train" / "r{rollout_id}_rank{rank}.pt")
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        "--load-debug-rollout-data",
        template,
        "--actor-num-gpus-per-node",
        "2",
        "--save-debug-train-data",
        train_template,
        "--check-precision",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The trainer agrees with the engine that made the dump (greedy: log-probs at temperature 1).
    assert (
        "--check-precision: passed at rollout 0" in proc.stderr and "|trainer - engine| mean" in proc.stderr
    )
    assert "mode: train only (no engine)" in proc.stderr and "engines: none" in proc.stderr
    assert "EngineActor" not in proc.stderr and "RolloutManager" not in proc.stderr
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == [0, 1]
    saved = [torch.load(template.format(rollout_id=i), weights_only=True)["samples"] for i in (0, 1)]
    for r, samples in zip(records, saved):
        assert r["train/grad_norm"] >= 0 and r["rollout/num_samples"] == len(samples)
        assert r["rollout/reward_mean"] == pytest.approx(sum(s["reward"] for s in samples) / len(samples))
        assert "rollout/train_rollout_logprob_abs_diff" in r
    # What each rank trained on joins the rollout dump sample by sample.
    for rollout_id, samples in enumerate(saved):
        ranks = [
            torch.load(train_template.format(rollout_id=rollout_id, rank=r), weights_only=True)
            for r in (0, 1)
        ]
        rows = [row for part in ranks for row in part["samples"]]
        assert sorted(row["sample_index"] for row in rows) == list(range(len(samples)))  # each sample once
        assert all(part["samples"] for part in ranks) and {p["world_size"] for p in ranks} == {2}
        for row in rows:
            s = samples[row["sample_index"]]
            assert row["tokens"] == s["tokens"] and row["reward"] == s["reward"]
            assert row["rollout_log_probs"] == s["rollout_log_probs"]
            assert len(row["log_probs"]) == len(row["advantages"]) == s["response_length"]


def test_a_missing_dump_exits_2_before_anything_starts(dumps, tiny_model, prompts, tmp_path):
    _, template, _ = dumps
    proc = run_job(
        "train.py", tiny_model, prompts, tmp_path, "--load-debug-rollout-data", template, "--num-rollout", "3"
    )
    assert proc.returncode == 2
    assert "1 of the 3 rollout dumps (--num-rollout) do not exist" in proc.stderr
    assert "rollout_2.pt" in proc.stderr and "Traceback" not in proc.stderr


def test_check_precision_names_a_temperature_mismatch_with_the_dump(dumps, tiny_model, prompts, tmp_path):
    _, template, _ = dumps
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        "--load-debug-rollout-data",
        template,
        "--check-precision",
        "--rollout-temperature",
        "0.5",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "--check-precision: 1 of 4 checks FAILED at rollout 0" in proc.stderr
    assert "  FAIL trainer vs engine log-probs (mean and max |diff|)" in proc.stderr
    assert (
        "temperature: the samples' log-probs are at temperature 1, the trainer computes at "
        "--rollout-temperature 0.5; use the same value" in proc.stderr
    )
    assert (
        not (tmp_path / "logs" / "metrics.jsonl").exists()
        or not (tmp_path / "logs" / "metrics.jsonl").read_text()
    )


def test_check_precision_fails_a_replay_with_other_weights(dumps, tiny_model_b, prompts, tmp_path):
    """The engine log-probs in the dump are another model's than the trainer's: the gap gate."""
    _, template, _ = dumps
    proc = run_job(
        "train.py",
        tiny_model_b,
        prompts,
        tmp_path,
        "--load-debug-rollout-data",
        template,
        "--check-precision",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "  FAIL trainer vs engine log-probs (mean and max |diff|)" in proc.stderr
    assert "the replayed dump was generated with other weights than --hf-checkpoint" in proc.stderr
    gates = json.loads((tmp_path / "logs" / "precision.json").read_text())["checks"]
    assert [g["name"] for g in gates if g["ok"] is False] == [
        "trainer vs engine log-probs (mean and max |diff|)"
    ]


def _train_metrics(tmp_path):
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [(r["train/loss"], r["train/pg_loss"], r["train/grad_norm"]) for r in records]


@pytest.mark.slow  # ~75 s; two ranks training like one is checked in-process (test_fsdp_actor)
def test_replay_is_deterministic_and_layout_independent(dumps, tiny_model, prompts, tmp_path):
    """The same dump replayed twice: bit-identical losses and grad norms; on 1 and on 2 FSDP
    ranks: equal within relative 1e-5 (rewards varied within groups so the gradients are not 0)."""
    from slime.rollout.dump import load_dump, save_dump

    _, template, _ = dumps
    varied = str(tmp_path / "varied" / "rollout_{rollout_id}.pt")
    for i in (0, 1):
        dump = load_dump(template.format(rollout_id=i))
        samples = []
        for k, s in enumerate(dump["samples"]):  # greedy samples of a group are alike: make them differ
            n, tokens = s["response_length"], list(s["tokens"])
            tokens[len(tokens) - n :] = [20 + (k * 7 + j) % 60 for j in range(n)]
            samples.append({**s, "tokens": tokens, "reward": float(k % 2)})
        save_dump(varied, i, samples, dump["meta"])
    runs = {}
    for name, ranks in (("one", "1"), ("again", "1"), ("two", "2")):
        out = tmp_path / name
        out.mkdir()
        proc = run_job(
            "train.py",
            tiny_model,
            prompts,
            out,
            "--load-debug-rollout-data",
            varied,
            "--actor-num-gpus-per-node",
            ranks,
            "--lr",
            "1e-3",
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = _train_metrics(out)
    assert runs["one"] == runs["again"]  # bit for bit
    assert all(g > 1e-3 for _, _, g in runs["one"])
    for a, b in zip(runs["one"], runs["two"]):
        for x, y in zip(a, b):
            assert abs(x - y) <= 1e-5 * max(abs(x), abs(y), 1e-12), (runs["one"], runs["two"])


# In -m slow (13 s): tests/test_deterministic.py runs whole seeded jobs twice and compares them
# bitwise, which covers this; the default suite keeps 10 minutes.
@pytest.mark.slow
def test_greedy_rollout_only_saves_the_same_dump_twice(dumps, tiny_model, prompts, tmp_path):
    _, template, _ = dumps
    again = str(tmp_path / "dumps" / "rollout_{rollout_id}.pt")
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--debug-rollout-only",
        "--save-debug-rollout-data",
        again,
        "--rollout-temperature",
        "0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for i in (0, 1):
        first = torch.load(template.format(rollout_id=i), weights_only=True)
        second = torch.load(again.format(rollout_id=i), weights_only=True)
        # Same prompts, groups, tokens, rewards; the engine's log-probs may differ in the last
        # bits with the batch composition (continuous batching), hence the tolerance. A sample's
        # trace records when things happened, which no two runs share.
        strip = [
            [{k: v for k, v in s.items() if k not in ("rollout_log_probs", "trace")} for s in d["samples"]]
            for d in (first, second)
        ]
        assert strip[0] == strip[1]
        for a, b in zip(first["samples"], second["samples"]):
            assert a["rollout_log_probs"] == pytest.approx(b["rollout_log_probs"], abs=1e-5)
        assert first["meta"]["tokenizer_fingerprint"] == second["meta"]["tokenizer_fingerprint"]
