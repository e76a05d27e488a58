"""--rollout-health-check-interval: a torch engine killed in the middle of a rollout; its groups
are generated again on the other engine, no sample is lost or duplicated, and the engine is
restarted before the next weight push (real Ray, real engines, a real kill)."""

from __future__ import annotations

import pytest
import torch

from tests.test_loop_e2e import prompts, run_job  # noqa: F401 - prompts is a fixture

KILLER = """
import os, psutil
calls = 0

def reward(args, sample):
    # At the first reward of the first rollout, kill one of this job's torch engines (children of
    # the EngineActor workers that share this raylet), while other groups still generate on it.
    global calls
    calls += 1
    if calls == 1:
        raylet = psutil.Process(os.getpid()).parent()
        engines = sorted((p for p in raylet.children(recursive=True)
                          if "slime.engines.torch_engine" in " ".join(p.cmdline())), key=lambda p: p.pid)
        engines[0].kill()
        print(f"KILLED ENGINE pid {engines[0].pid}", flush=True)
    return float(sample.response.strip() == sample.label)
"""

pytestmark = pytest.mark.e2e


def test_a_killed_engine_loses_no_sample_and_is_restarted(tiny_model, prompts, tmp_path):  # noqa: F811
    (tmp_path / "killer_rm.py").write_text(KILLER)
    template = str(tmp_path / "dumps" / "r_{rollout_id}.pt")
    proc = run_job("train.py", tiny_model, prompts, tmp_path, "--custom-rm-path", "killer_rm.reward",
                   "--rollout-num-gpus", "2", "--rollout-health-check-interval", "0.5",
                   "--rollout-health-check-timeout", "5", "--rollout-max-response-len", "48", "--num-rollout", "3",
                   "--save-debug-rollout-data", template, "--check-weight-sync")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "KILLED ENGINE pid" in proc.stderr + proc.stdout
    assert "is down:" in proc.stderr and "its group is generated again" in proc.stderr
    assert "was down" in proc.stderr and "restarted at http://" in proc.stderr
    for i in range(3):
        samples = torch.load(template.format(rollout_id=i), weights_only=True)["samples"]
        assert len(samples) == 8  # 4 prompts x 2: none lost
        groups = [s["group_index"] for s in samples]
        assert sorted(groups) == [0, 0, 1, 1, 2, 2, 3, 3]  # none twice
        assert len({s["metadata"]["prompt_index"] for s in samples}) == 4
    # The restarted engine was given the current weights and matches the trainer's (checked).
    assert proc.stderr.count("--check-weight-sync: 46 tensors match on every engine") == 3
