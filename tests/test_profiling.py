"""--use-pytorch-profiler on the FSDP actor (one gloo rank): which train calls get a window, what
each leaves (a Chrome trace with the phases labelled, an operator table), and the flags' errors."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os

import pytest

from slime.config.arguments import build_parser
from slime.config.profile import ProfileConfig, profile_config
from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import base_config, make_batch


def train_profiled(rank, world_size, init_method, model, profile):
    from slime.backends.fsdp.actor import FSDPTrainActor

    cfg = dataclasses.replace(base_config(model, micro_batch_size=2), profile=profile)
    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    actor.init()
    for rollout_id in (7, 8, 9):  # train calls 0, 1, 2 of this process (a resumed run's ids)
        actor.train(rollout_id, make_batch(rollout_id))
    actor.close()


def trace_names(path: str) -> set[str]:
    with gzip.open(path) as f:
        return {e.get("name") for e in json.load(f)["traceEvents"]}


def test_train_overall_profiles_the_chosen_calls_with_their_phases_labelled(tiny_model, tmp_path):
    profile = ProfileConfig(enabled=True, step_start=1, step_end=2, out_dir=str(tmp_path))
    run_ranks(1, train_profiled, tiny_model, profile)
    assert sorted(os.listdir(tmp_path)) == [
        "train_overall_rank_0.rollout_8.pt.trace.json.gz",
        "train_overall_rank_0.rollout_8.txt",
    ]
    names = trace_names(str(tmp_path / "train_overall_rank_0.rollout_8.pt.trace.json.gz"))
    assert {"train_log_probs", "train_actor", "aten::mm"} <= names
    table = (tmp_path / "train_overall_rank_0.rollout_8.txt").read_text()
    assert "by the host's own time" in table
    rows = [line.split()[0] for line in table.splitlines() if line.strip().startswith("aten::")]
    assert "aten::mm" in rows or "aten::addmm" in rows, table


def test_phase_targets_get_windows_of_their_own(tiny_model, tmp_path):
    profile = ProfileConfig(
        enabled=True,
        step_start=0,
        step_end=1,
        targets=("train_actor", "train_log_probs"),
        out_dir=str(tmp_path),
    )
    run_ranks(1, train_profiled, tiny_model, profile)
    files = sorted(os.listdir(tmp_path))
    assert files == [
        "train_actor_rank_0.rollout_7.pt.trace.json.gz",
        "train_actor_rank_0.rollout_7.txt",
        "train_log_probs_rank_0.rollout_7.pt.trace.json.gz",
        "train_log_probs_rank_0.rollout_7.txt",
    ]
    # the train steps' window holds the backward pass, the log-prob pass's does not
    actor = trace_names(str(tmp_path / files[0]))
    log_probs = trace_names(str(tmp_path / files[2]))
    assert any("Backward" in str(n) for n in actor)
    assert not any("Backward" in str(n) for n in log_probs)


def parse(*argv: str):
    return build_parser().parse_args(["--hf-checkpoint", "m", *argv])


def test_the_flags_fill_the_record_and_the_directory_defaults_to_the_logs(monkeypatch, tmp_path):
    monkeypatch.delenv("SLIME_LOG_DIR", raising=False)
    ns = parse("--use-pytorch-profiler", "--save", str(tmp_path / "ckpt"), "--profile-target", "train_actor")
    cfg = profile_config(ns)
    assert (cfg.enabled, cfg.step_start, cfg.step_end, cfg.targets) == (True, 10, 12, ("train_actor",))
    assert cfg.out_dir == str(tmp_path / "ckpt" / "logs" / "profile")
    monkeypatch.setenv("SLIME_LOG_DIR", str(tmp_path / "logs"))
    assert profile_config(parse("--use-pytorch-profiler")).out_dir == str(tmp_path / "logs" / "profile")
    given = profile_config(parse("--use-pytorch-profiler", "--tensorboard-dir", str(tmp_path / "tb")))
    assert given.out_dir == str(tmp_path / "tb")


@pytest.mark.parametrize("start,end", [(3, 3), (5, 2), (-1, 2)])
def test_an_empty_or_negative_window_is_refused_naming_the_flags(start, end):
    ns = parse("--use-pytorch-profiler", "--profile-step-start", str(start), "--profile-step-end", str(end))
    with pytest.raises(ValueError, match=r"--profile-step-start .* --profile-step-end"):
        profile_config(ns)
    profile_config(
        parse("--profile-step-start", str(start), "--profile-step-end", str(end))
    )  # off: unchecked


def test_an_unknown_target_is_refused_naming_the_flag():
    with pytest.raises(Exception, match="--profile-target: invalid choice: 'train_critic'"):
        parse("--profile-target", "train_critic")


# ---- the torch engine's /start_profile and /stop_profile (SGLang's routes) ----------------------


def post(url: str, path: str, body: dict | None = None) -> tuple[int, str]:
    import requests

    r = requests.post(url + path, json=body, timeout=60)
    return r.status_code, r.text


@pytest.fixture(scope="module")
def profiled(tiny_model, tmp_path_factory):
    """A torch engine started with SGLANG_TORCH_PROFILER_DIR (where its profiles may go)."""
    from tests.conftest import start_engine

    root = tmp_path_factory.mktemp("profiles")
    proc = start_engine(
        tiny_model, tmp_path_factory.mktemp("engine-logs"), env={"SGLANG_TORCH_PROFILER_DIR": str(root)}
    )
    proc.root = root
    yield proc
    assert proc.stop() in (0, -15)


def test_an_engine_profile_closes_itself_after_num_steps(profiled):
    out = profiled.root / "closes"
    body = {"output_dir": "closes", "num_steps": 3, "profile_prefix": "t"}
    assert post(profiled.url, "/start_profile", body) == (200, "Start profiling.\n")
    status, _ = post(
        profiled.url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8}}
    )
    assert status == 200
    # the window closed after its third step, on the engine thread, before the request finished
    files = sorted(os.listdir(out))
    assert len(files) == 2 and files[0].startswith("t-") and files[0].endswith("-TP-0.trace.json.gz"), files
    assert files[1] == files[0].replace(".trace.json.gz", ".txt")
    assert any(str(n).startswith("aten::") for n in trace_names(str(out / files[0])))
    assert "by the host's own time" in (out / files[1]).read_text()
    status, text = post(profiled.url, "/stop_profile")
    assert status == 400 and "Profiling is not in progress" in text


def test_an_engine_profile_runs_until_stopped_and_refuses_a_second_start(profiled):
    body = {"output_dir": "until", "activities": ["CPU"]}
    assert post(profiled.url, "/start_profile", body)[0] == 200
    status, text = post(profiled.url, "/start_profile", body)
    assert status == 400 and "already in progress" in text
    assert (
        post(profiled.url, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}})[0]
        == 200
    )
    assert post(profiled.url, "/stop_profile") == (200, "Stop profiling. This will take some time.\n")
    traces = [f for f in os.listdir(profiled.root / "until") if f.endswith("-TP-0.trace.json.gz")]
    assert len(traces) == 1
    # without output_dir: the directory itself; a window whose start step never comes writes nothing
    assert post(profiled.url, "/start_profile", {"start_step": 10**9})[0] == 200
    before = set(os.listdir(profiled.root))
    assert post(profiled.url, "/stop_profile")[0] == 200
    assert set(os.listdir(profiled.root)) == before


@pytest.mark.parametrize(
    "body,names",
    [
        ({"activities": ["MEM"]}, "'activities'"),
        ({"activities": ["GPU"]}, "'activities'"),  # no GPU on this engine
        ({"profile_by_stage": True}, "'profile_by_stage'"),
        ({"num_steps": 0}, "'num_steps'"),
        ({"start_step": -1}, "'start_step'"),
        ({"with_stack": "yes"}, "'with_stack'"),
        ({"profile_prefix": "../x"}, "'profile_prefix'"),
        ({"output_dir": "../elsewhere"}, "outside the directory"),
        ({"output_dir": "/tmp"}, "outside the directory"),
    ],
)
def test_an_engine_profile_request_the_engine_cannot_serve_is_refused(profiled, body, names):
    status, text = post(profiled.url, "/start_profile", body)
    assert status in (400, 403) and names in text, text
    assert post(profiled.url, "/stop_profile")[0] == 400  # nothing was started
    assert not (profiled.root.parent / "elsewhere").exists()


def test_an_engine_without_a_profile_directory_refuses_saying_how(engine):
    status, text = post(engine.url, "/start_profile", {"num_steps": 1})
    assert status == 403 and "SGLANG_TORCH_PROFILER_DIR=DIR" in text
