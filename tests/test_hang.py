"""--hang-timeout: the watchdog on its own, and a 2-rank job in which one rank is made to hang."""

from __future__ import annotations

import threading
import time

import pytest

from slime.debug.hang import HangWatchdog, format_stacks
from tests.test_loop_e2e import prompts, run_job  # noqa: F401 - prompts is a fixture


def _stuck_in_a_named_function(seconds):
    time.sleep(seconds)


def test_the_watchdog_writes_every_thread_once_a_phase_overruns(tmp_path):
    path = tmp_path / "hang" / "rank3.txt"
    dog = HangWatchdog(0.3, str(path), header="train rank 3 of 4, ")
    with dog.watch("a quick phase"):
        pass
    time.sleep(0.5)
    assert not path.exists() and dog.fired == []
    helper = threading.Thread(target=_stuck_in_a_named_function, args=(1.5,), name="helper-thread")
    helper.start()
    with dog.watch("the train step of rollout 7"):
        _stuck_in_a_named_function(1.0)
    helper.join()
    text = path.read_text()
    assert text.startswith("train rank 3 of 4, pid ") and "the train step of rollout 7 has run" in text
    assert "(--hang-timeout 0.3 s)" in text and dog.fired == ["the train step of rollout 7"]
    _, first, *others = text.split("\nThread ")
    assert (
        first.startswith('"MainThread"') and "_stuck_in_a_named_function" in first
    )  # the phase's thread first
    assert any(t.startswith('"helper-thread"') and "_stuck_in_a_named_function" in t for t in others)
    assert "slime-hang-watchdog" not in text


def test_the_driver_waits_for_the_dumps_of_its_own_ranks(tmp_path):
    """PPO's critic ranks write criticrank{r}.txt beside the actor's rank{r}.txt: each group waits
    for its own files (a critic group found none before and waited out the grace period)."""
    from slime.debug.hang import wait_for_dumps

    for name in ("rank0.txt", "criticrank0.txt", "criticrank1.txt"):
        (tmp_path / name).write_text("stack")
    assert wait_for_dumps(str(tmp_path), 2, prefix="critic") == ["criticrank0.txt", "criticrank1.txt"]
    assert wait_for_dumps(str(tmp_path), 2, grace_s=0.2) == ["rank0.txt"]


def test_format_stacks_names_threads():
    assert 'Thread "MainThread"' in format_stacks()


SITECUSTOMIZE = """
import os, sys, time
if os.environ.get("HANG_RANK") and "default_worker.py" in " ".join(sys.argv):
    import slime.backends.fsdp.actor as actor_module

    def simulated_hang():
        time.sleep(3600)

    original = actor_module.FSDPTrainActor.train

    def train(self, rollout_id, batch):
        if self.rank == int(os.environ["HANG_RANK"]) and rollout_id == 1:
            simulated_hang()
        return original(self, rollout_id, batch)

    actor_module.FSDPTrainActor.train = train
"""


@pytest.mark.slow  # ~40 s; the watchdog and the driver's wait are tested in process above
@pytest.mark.e2e
def test_a_hung_rank_ends_the_job_with_every_ranks_stacks(tiny_model, prompts, tmp_path):
    """Rank 1 stops in Python at rollout 1; rank 0 waits for it inside an FSDP collective. Both
    stacks are written and the job exits 1 long before the hang would end (subprocess timeout)."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    start = time.monotonic()
    # The workers read HANG_RANK and sitecustomize.py at start-up (run_job's runtime environment).
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--actor-num-gpus-per-node",
        "2",
        "--hang-timeout",
        "10",
        env={"HANG_RANK": "1"},
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    hang_dir = tmp_path / "logs" / "hang"
    assert (
        f"the train step of rollout 1 has run longer than --hang-timeout 10 s: the Python stacks of 2 of 2 "
        f"train ranks are in {hang_dir}/ (rank0.txt, rank1.txt)" in proc.stderr
    )
    rank0, rank1 = (hang_dir / "rank0.txt").read_text(), (hang_dir / "rank1.txt").read_text()
    assert rank1.startswith("train rank 1 of 2") and "simulated_hang" in rank1
    assert rank0.startswith("train rank 0 of 2") and "simulated_hang" not in rank0
    assert "torch/distributed" in rank0  # waiting in a collective for rank 1
    assert "rollout 1/2" in proc.stderr and "rollout 2/2" not in proc.stderr
    assert elapsed < 600  # not the hour the rank sleeps
