"""The demo's tools: the task generator, the SFT warm start, the metrics plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_task_splits_are_disjoint_complete_and_deterministic(tmp_path):
    from slime.tools.make_demo_task import main

    assert (
        main(
            [
                "--out",
                str(tmp_path / "a"),
                "--max-a",
                "19",
                "--max-b",
                "4",
                "--eval-size",
                "10",
                "--sft-size",
                "20",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "--out",
                str(tmp_path / "b"),
                "--max-a",
                "19",
                "--max-b",
                "4",
                "--eval-size",
                "10",
                "--sft-size",
                "20",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    splits = {name: _rows(tmp_path / "a" / f"{name}.jsonl") for name in ("eval", "sft", "train")}
    assert [len(splits[n]) for n in ("eval", "sft", "train")] == [10, 20, 90]
    held_out = {r["prompt"] for r in splits["eval"]}
    train = {r["prompt"] for r in splits["train"]}
    assert not held_out & train and len(held_out | train) == 100  # every problem, held out or trained
    assert {r["prompt"] for r in splits["sft"]} <= train
    for r in splits["eval"] + splits["train"]:
        a, b = r["prompt"].rstrip("=").split("+")
        assert r["label"] == str(int(a) + int(b))
    assert all(r["response"] == str(sum(map(int, r["prompt"][:-1].split("+")))) for r in splits["sft"])
    for name in ("eval", "sft", "train"):
        assert (tmp_path / "a" / f"{name}.jsonl").read_bytes() == (
            tmp_path / "b" / f"{name}.jsonl"
        ).read_bytes()


def test_task_sizes_that_leave_no_train_problems_exit_2(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slime.tools.make_demo_task",
            "--out",
            str(tmp_path),
            "--max-a",
            "9",
            "--max-b",
            "9",
            "--eval-size",
            "60",
            "--sft-size",
            "41",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "--eval-size 60 + --sft-size 41" in proc.stderr and "Traceback" not in proc.stderr
    assert not os.listdir(tmp_path)


def _loss_on(model_dir, examples):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for tokens, n, _ in examples:
            logits = model(torch.tensor([tokens])).logits[0, :-1]
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
            total += float(-lp[-n:].mean())
    return total / len(examples)


# megatron (~8 s, slow): the same tool and loss; the Megatron actor's training is the actor tests'
@pytest.mark.parametrize("backend", ["fsdp", pytest.param("megatron", marks=pytest.mark.slow)])
def test_sft_lowers_the_response_loss_and_writes_a_loadable_checkpoint(tiny_model, tmp_path, backend):
    from transformers import AutoTokenizer

    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="megatron-core is not installed")

    from slime.tools.sft import load_examples

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"q": f"{a}+1=", "a": str(a + 1)}) + "\n" for a in range(8)))
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slime.tools.sft",
            "--hf-checkpoint",
            tiny_model,
            "--data",
            str(data),
            "--input-key",
            "q",
            "--response-key",
            "a",
            "--save-hf",
            str(out),
            "--num-epoch",
            "6",
            "--global-batch-size",
            "4",
            "--micro-batch-size",
            "2",
            "--lr",
            "3e-3",
            "--train-backend",
            backend,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "epoch 6/6: 2 steps" in proc.stderr
    assert not os.path.exists(str(out) + ".partial")
    tok = AutoTokenizer.from_pretrained(str(out))
    examples = load_examples(str(data), tok, "q", "a", chat=False)
    assert examples[0][1] == 2  # "1" + eos: the loss covers the end of the answer
    assert examples[0][0][-1] == tok.eos_token_id
    before, after = _loss_on(tiny_model, examples), _loss_on(str(out), examples)
    assert after < 0.5 * before, (before, after)


def test_sft_megatron_layout_that_does_not_fit_exits_2(tiny_model, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slime.tools.sft",
            "--hf-checkpoint",
            tiny_model,
            "--data",
            str(data),
            "--save-hf",
            str(tmp_path / "out"),
            "--train-backend",
            "megatron",
            "--tensor-model-parallel-size",
            "2",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "= 2 does not divide the 1 ranks" in proc.stderr and "Traceback" not in proc.stderr


def test_sft_missing_response_key_exits_2_naming_row_and_flag(tiny_model, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slime.tools.sft",
            "--hf-checkpoint",
            tiny_model,
            "--data",
            str(data),
            "--save-hf",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2
    assert f"{data}:1" in proc.stderr and "--response-key" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_plot_writes_a_png_from_metrics(tmp_path):
    pytest.importorskip("matplotlib")
    from slime.tools.plot_metrics import main, read_series

    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": 0, "eval/accuracy": 0.2}] + [
        {"step": s, "rollout/reward_mean": s / 4, "eval/accuracy": (s + 1) / 4} for s in (1, 2, 3)
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    series = read_series(str(metrics), ["rollout/reward_mean", "eval/accuracy"])
    assert series["eval/accuracy"] == [(0, 0.2), (1, 0.5), (2, 0.75), (3, 1.0)]
    assert [s for s, _ in series["rollout/reward_mean"]] == [1, 2, 3]
    assert main([str(metrics)]) == 0
    png = (tmp_path / "reward_accuracy.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    # several runs, labelled
    assert (
        main([f"A={metrics}", f"B={metrics}", "--keys", "eval/accuracy", "--out", str(tmp_path / "c.png")])
        == 0
    )
    assert (tmp_path / "c.png").read_bytes() != png
    with pytest.raises(SystemExit):
        main([f"A={metrics}", f"B={tmp_path / 'missing.jsonl'}"])


def test_the_demos_last_line(tmp_path, capsys):
    """`--since`: the line run-tiny-cpu.sh and run-vision-cpu.sh end with."""
    import time

    pytest.importorskip("matplotlib")
    from slime.tools.plot_metrics import main

    metrics = tmp_path / "metrics.jsonl"
    records = [
        {"step": 0, "eval/accuracy": 0.25},
        {"step": 5, "rollout/reward_mean": 0.5},
        {"step": 10, "eval/accuracy": 0.8},
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main([str(metrics), "--since", str(time.time() - 42)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(
        "held-out accuracy: 0.250 at step 0 (before RL) -> 0.800 at step 10 (+55.0 points); whole demo 4"
    )
