"""Bad user inputs end the job with exit code 2 and one line naming the input and the fix: read in
the driver before Ray starts, or, when only an actor can find the problem, carried back from it."""

from __future__ import annotations

import json
import logging

import pytest

from slime.ray.main import main


@pytest.fixture(autouse=True)
def log_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIME_LOG_DIR", str(tmp_path / "logs"))


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(4))
    )
    return path


def run_main(capfd, tiny_model, prompts, *extra):
    """main() in this process; the one line it logged (stderr)."""
    argv = [
        "--hf-checkpoint",
        str(tiny_model),
        "--prompt-data",
        str(prompts),
        "--rollout-batch-size",
        "2",
        "--num-rollout",
        "1",
        "--rm-type",
        "exact",
        *extra,
    ]
    try:
        code = main(argv)
    finally:
        logging.getLogger().handlers[:] = []  # main() configured the root logger for its process
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if " ERROR " in line]
    return code, lines, err


def test_a_malformed_prompt_line_is_named_before_ray_starts(capfd, tiny_model, data, tmp_path):
    import ray

    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text() + '{"prompt": "1+1=", "label": \n')
    code, lines, err = run_main(capfd, tiny_model, bad)
    assert code == 2 and not ray.is_initialized()
    assert len(lines) == 1 and f"{bad}:5: not valid JSON" in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--eval-interval", "1", "--eval-prompt-data", "{eval}"],
            "{eval}:1: no field 'prompt' (--input-key)",
        ),
        (
            ["--custom-rm-path", "no_such_module.reward"],
            "--custom-rm-path 'no_such_module.reward': cannot import",
        ),
        (
            ["--dynamic-sampling-filter-path", "json.no_such_filter"],
            "module 'json' has no function 'no_such_filter'",
        ),
        (["--use-kl-loss", "--ref-load", "{tmp}"], "--ref-load '{tmp}' has no config.json"),
    ],
)
def test_each_kind_of_input_is_checked_in_the_driver(capfd, tiny_model, data, tmp_path, extra, message):
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"question": "1+1="}) + "\n")
    fill = {"eval": str(evals), "tmp": str(tmp_path)}
    code, lines, err = run_main(capfd, tiny_model, data, *[a.format(**fill) for a in extra])
    assert code == 2 and len(lines) == 1 and message.format(**fill) in lines[0], err[-2000:]
    assert "Traceback" not in err


def test_a_checkpoint_that_is_not_hugging_face_is_refused(capfd, data, tmp_path):
    code, lines, _ = run_main(capfd, tmp_path, data)
    assert code == 2 and f"--hf-checkpoint '{tmp_path}' has no config.json" in lines[0]


@pytest.mark.e2e
def test_a_usage_error_inside_an_actor_is_one_line_and_exit_2(capfd, monkeypatch, tiny_model, data):
    from tests.ray_cluster import shared_address

    monkeypatch.setenv("RAY_ADDRESS", shared_address())  # this process attaches, as train.py would
    # Only the rollout manager tokenizes the prompts: that every prompt is too long is found there.
    code, lines, err = run_main(
        capfd, tiny_model, data, "--rollout-max-prompt-len", "1", "--debug-rollout-only"
    )
    assert code == 2, err[-3000:]
    assert len(lines) == 1 and "every prompt is longer than --rollout-max-prompt-len 1" in lines[0]
    assert "Traceback" not in lines[0]
