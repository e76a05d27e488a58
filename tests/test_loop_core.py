"""The loop core in-process, with small fakes of its three parts that record every call: the order
of calls for each schedule and debug mode, in milliseconds, without Ray or any process."""

from __future__ import annotations

import pytest

from slime.loop import hooks
from slime.loop.core import ONE_STEP_OFF, SYNC, Hook, Loop
from slime.loop.metrics import Metrics
from slime.utils.rollout_batch import Evaluation, Rollout, TrainOutput


class FakeSource:
    """Rollouts whose samples carry the weight version the trainer had when they were started."""

    def __init__(self, log: list, replayed: bool = False, lag: int = 0):
        self.log, self.replayed, self.lag = log, replayed, lag
        self.versions: dict[int, int] = {}

    def start(self, rollout_id, weight_version):
        self.log.append(("start", rollout_id, weight_version))
        self.versions[rollout_id] = weight_version - self.lag

    def wait(self, rollout_id):
        self.log.append(("wait", rollout_id))
        return Rollout(
            rollout_id,
            {"rollout/reward_mean": 0.5, "time/generate": 0.25, "perf/request/e2e_latency/mean": 0.125},
            4,
            (None if self.replayed else str(self.versions[rollout_id]),),
            data_state=None if self.replayed else {"offset": rollout_id + 1},
            parts=("part0",),
            replayed=self.replayed,
        )

    def restore(self, data_state):
        self.log.append(("restore", data_state))

    def evaluate(self, rollout_id):
        self.log.append(("evaluate", rollout_id))
        return Evaluation({"eval/accuracy": 1.0})


class FakeTrain:
    def __init__(self, log: list, resumed: int | None = None, failing_pushes: int = 0):
        self.log = log
        self.resumed_rollout_id = resumed
        self.resumed_data_state = None if resumed is None else {"offset": resumed + 1}
        self.failing_pushes = failing_pushes  # the next pushes that fail (an engine died in them)
        self.connected: tuple = ("http://e0",)

    def train(self, rollout):
        self.log.append(("train", rollout.rollout_id))
        return TrainOutput(
            steps=[{"loss": 1.0}],
            rollout={"log_probs": -1.0},
            timings={"log_probs": 0.0, "train": 0.0},
            perf={"actor_train_tok_per_s": 100.0},
        )

    def push_weights(self, version):
        self.log.append(("push", version))
        if self.failing_pushes:
            self.failing_pushes -= 1
            raise RuntimeError("connection lost during POST /update_weights_from_tensor")
        return {"bytes": 64.0}

    def connect(self, engines, only=None):
        self.connected = tuple(engines.urls[j] for j in (only if only is not None else engines.targets()))
        self.log.append(("connect", self.connected))

    def connected_to(self, engines):
        return tuple(engines.urls[j] for j in engines.targets()) == self.connected

    def ensure_connected(self, engines):
        if not self.connected_to(engines):
            self.connect(engines)

    def save(self, rollout_id, data_state):
        self.log.append(("save", rollout_id, data_state))

    def save_hf(self):
        self.log.append(("save_hf",))

    def wake(self):
        self.log.append(("wake",))

    def sleep(self, keep_params=False):
        self.log.append(("sleep", keep_params))


class FakeEngines:
    """One engine, "http://e0". `down_at_push`: the pushes (counted from 1) before which it was
    found down and restarted; `down_after_failed_push`: probe() finds it down after a failed push."""

    def __init__(self, log: list, down_at_push: set[int] = frozenset(), down_after_failed_push: bool = False):
        self.log, self.urls, self.down_at_push, self.pushes = log, ["http://e0"], down_at_push, 0
        self.down_after_failed_push = down_after_failed_push
        self.joining: dict[int, str] = {}

    def release_memory(self):
        self.log.append(("release",))

    def resume_memory(self, tags):
        self.log.append(("resume", tags))

    def up_urls(self):
        return [u for j, u in enumerate(self.urls) if j not in self.joining]

    def targets(self):
        return [0]

    def heal(self, wait=False):
        if wait:
            self.pushes += 1
            if self.pushes in self.down_at_push:
                self.urls = [f"http://e0-restart{self.pushes}"]
                self.joining = {0: self.urls[0]}
                self.log.append(("restart",))
        return sorted(self.joining)

    def probe(self):
        if not self.down_after_failed_push:
            return {}
        self.log.append(("probe",))
        self.down_after_failed_push = False
        self.urls = ["http://e0-restarted"]
        self.joining = {0: self.urls[0]}
        return {0: "does not answer /health"}

    def admit(self, indices):
        for j in indices:
            self.log.append(("admit", self.joining.pop(j)))

    def pause_checks(self):
        pass

    def resume_checks(self):
        pass

    def snapshot_weights(self):
        self.log.append(("snapshot",))

    def scramble_weights(self):
        self.log.append(("scramble",))

    def compare_weights(self):
        self.log.append(("compare",))
        return []

    def dump_parameters(self, root):
        self.log.append(("dump", root))
        return [46]


class Sink:
    steps_per_rollout = None

    def __init__(self):
        self.records: list[tuple[int, dict]] = []

    def log(self, record, step):
        self.records.append((step * (self.steps_per_rollout or 1), record))


PUSH = [
    ("sleep", True),
    ("resume", ("weights",)),
    "push",
    ("sleep", False),
    ("resume", ("kv_cache", "cuda_graph")),
]


def push(version: int) -> list:
    return [("push", version) if c == "push" else c for c in PUSH]


def make(
    log,
    total=2,
    schedule=SYNC,
    extra_hooks=(),
    resumed=None,
    source=None,
    train=True,
    engines=True,
    sink=None,
):
    source = source or FakeSource(log)
    t = FakeTrain(log, resumed) if train else None
    e = engines if isinstance(engines, FakeEngines) else FakeEngines(log) if engines else None
    return Loop(source, t, e, schedule, [*extra_hooks, Metrics(sink or Sink())], total)


def test_sync_generates_trains_and_pushes_each_rollout_in_turn():
    log: list = []
    sink = Sink()
    make(log, sink=sink).run()
    step = [("release",), ("wake",)]
    assert log == [
        ("start", 0, 0),
        ("wait", 0),
        *step,
        ("train", 0),
        *push(1),
        ("start", 1, 1),
        ("wait", 1),
        *step,
        ("train", 1),
        *push(2),
    ]
    assert [s for s, _ in sink.records] == [1, 2]
    record = sink.records[0][1]
    assert (
        record["push/bytes"] == 64.0 and record["train/loss"] == 1.0 and record["rollout/log_probs"] == -1.0
    )
    assert record["perf/actor_train_tok_per_s"] == 100.0  # the train rank's perf/* as they came
    assert record["perf/request/e2e_latency/mean"] == 0.125  # the rollout's (from its traces), too
    assert record["time/generate"] == 0.25 and "time/generate" not in {
        k for k in record if k.startswith("rollout/")
    }
    assert 0 <= record["time/idle_ratio"] <= 1 and record["time/step"] >= record["time/push"]
    # The phases' parts, inside them (slime's perf/*_time names, and the engines' memory).
    parts = {
        k: record[f"perf/{k}_time"]
        for k in ("sleep", "wake_up", "update_weights", "rollout_offload", "rollout_onload")
    }
    assert all(v >= 0 for v in parts.values())
    assert parts["sleep"] + parts["update_weights"] + parts["rollout_onload"] <= record["time/push"]
    assert parts["wake_up"] + parts["rollout_offload"] <= record["time/colocate"]
    # slime's train wait: from the loop's start (then the last train call's end) to this call.
    second = sink.records[1][1]
    for r in (record, second):
        assert r["perf/step_time"] == pytest.approx(r["perf/train_wait_time"] + r["perf/train_time"])
        assert r["perf/wait_time_ratio"] == pytest.approx(r["perf/train_wait_time"] / r["perf/step_time"])
    # The second wait spans the first step's push (and the second generation).
    assert second["perf/train_wait_time"] >= record["time/push"] and 0 < second["perf/wait_time_ratio"] < 1


def test_one_step_off_starts_the_next_rollout_before_training_and_pushes_when_it_is_done():
    log: list = []
    make(log, total=3, schedule=ONE_STEP_OFF).run()
    assert log == [
        ("start", 0, 0),
        ("wait", 0),
        ("start", 1, 0),
        ("wake",),
        ("train", 0),
        ("wait", 1),
        *push(1),  # engines keep their memory: rollout 1 runs on them
        ("wait", 1),
        ("start", 2, 1),
        ("wake",),
        ("train", 1),
        ("wait", 2),
        *push(2),
        ("wait", 2),
        ("release",),
        ("wake",),
        ("train", 2),
        *push(3),  # nothing left to generate
    ]


def test_update_weights_interval_pushes_after_every_nth_rollout_and_widens_the_lag():
    log: list = []
    source = FakeSource(log)
    loop = Loop(source, FakeTrain(log, None), FakeEngines(log), SYNC, [Metrics(Sink())], 4, push_interval=2)
    loop.run()
    assert [c for c in log if isinstance(c, tuple) and c[0] == "push"] == [("push", 2), ("push", 4)]
    assert log.index(("train", 1)) < log.index(("push", 2)) < log.index(("start", 2, 2))
    assert loop.schedule.max_lag == 1  # rollout 1 ran on version 0 while the trainer was at 1
    one_off = Loop(FakeSource([]), FakeTrain([], None), FakeEngines([]), ONE_STEP_OFF, [], 2, push_interval=3)
    assert one_off.schedule.max_lag == 3


def test_records_count_optimizer_steps_with_wandb_always_use_train_step():
    class TwoSteps(FakeTrain):
        def train(self, rollout):
            out = super().train(rollout)
            out.steps.append({"loss": 0.5})
            return out

    sink = Sink()
    Loop(
        FakeSource([]), TwoSteps([], None), FakeEngines([]), SYNC, [Metrics(sink, train_steps=True)], 3
    ).run()
    assert [s for s, _ in sink.records] == [2, 4, 6]


def test_start_rollout_id_is_the_first_rollout():
    log: list = []
    Loop(FakeSource(log), FakeTrain(log, None), FakeEngines(log), SYNC, [Metrics(Sink())], 4, start=2).run()
    # the engines hold version 0: the trainer's weights go to them first, as after a resume
    assert log[:6] == [*push(2), ("start", 2, 2)] and ("train", 3) in log and ("train", 1) not in log


def test_staleness_beyond_the_schedule_is_refused():
    # One step off, rollout k+1 is generated while version k is current: one version of lag is
    # the schedule itself; a sample older still (an engine that missed a push) is refused.
    with pytest.raises(
        RuntimeError, match="generated with weight_version -1 while the trainer is at 0: more than 0"
    ):
        make([], source=FakeSource([], lag=1)).run()
    with pytest.raises(
        RuntimeError,
        match="rollout 1 was generated with weight_version -1 while the trainer is at 1: more than 1",
    ):
        make([], total=3, schedule=ONE_STEP_OFF, source=FakeSource([], lag=1)).run()


def test_rollout_only_generates_and_evaluates_without_a_trainer():
    log: list = []
    sink = Sink()
    source = FakeSource(log)
    evaluate = hooks.Evaluate(source, interval=2, before_train=True, log=sink.log)
    make(
        log,
        total=4,
        schedule=ONE_STEP_OFF,
        source=source,
        train=False,
        engines=False,
        extra_hooks=[evaluate],
        sink=sink,
    ).run()
    # One step off changes nothing without a trainer: no version moves, nothing runs ahead.
    assert log == [
        ("evaluate", -1),
        ("start", 0, 0),
        ("wait", 0),
        ("start", 1, 0),
        ("wait", 1),
        ("evaluate", 1),
        ("start", 2, 0),
        ("wait", 2),
        ("start", 3, 0),
        ("wait", 3),
        ("evaluate", 3),
    ]
    assert [s for s, _ in sink.records] == [0, 1, 2, 3, 4]
    assert "eval/accuracy" in sink.records[2][1] and "eval/accuracy" not in sink.records[1][1]
    assert sink.records[1][1]["rollout/reward_mean"] == 0.5 and "time/eval" in sink.records[0][1]


def test_train_only_replays_without_engines_or_pushes():
    log: list = []
    make(log, source=FakeSource(log, replayed=True), engines=False).run()
    assert log == [
        ("start", 0, 0),
        ("wait", 0),
        ("wake",),
        ("train", 0),
        ("start", 1, 1),
        ("wait", 1),
        ("wake",),
        ("train", 1),
    ]


def test_resume_restores_the_data_position_and_pushes_before_the_next_rollout():
    log: list = []
    save = hooks.Save(interval=None, save=True, save_hf=True)
    make(log, total=4, resumed=1, extra_hooks=[save]).run()
    assert log[:7] == [("restore", {"offset": 2}), *push(2), ("start", 2, 2)]
    assert ("start", 0, 0) not in log and ("train", 2) in log and ("train", 1) not in log
    # Saved once at the end, with the data position after the last rollout; then the HF export.
    assert log[-2:] == [("save", 3, {"offset": 4}), ("save_hf",)]


def test_save_every_interval_and_not_again_at_the_end():
    log: list = []
    make(log, total=4, extra_hooks=[hooks.Save(interval=2, save=True, save_hf=False)]).run()
    assert [c for c in log if c[0] == "save"] == [("save", 1, {"offset": 2}), ("save", 3, {"offset": 4})]
    log.clear()
    make(log, total=3, extra_hooks=[hooks.Save(interval=2, save=True, save_hf=False)]).run()
    assert [c for c in log if c[0] == "save"] == [("save", 1, {"offset": 2}), ("save", 2, {"offset": 3})]


def test_sync_parameters_dump_pushes_between_two_dumps_and_ends_the_job():
    log: list = []
    make(log, extra_hooks=[hooks.SyncParametersDump("/d")]).run()
    assert log == [("dump", "/d/before_sync_parameter"), *push(0), ("dump", "/d/after_sync_parameter")]


def test_weight_update_equal_scrambles_then_pushes_then_compares_before_the_first_rollout():
    log: list = []
    make(log, total=1, extra_hooks=[hooks.WeightUpdateEqualCheck()]).run()
    assert log[:8] == [("snapshot",), ("scramble",), *push(0), ("compare",)]
    assert log[8] == ("start", 0, 0)
    log.clear()
    make(log, total=3, resumed=1, extra_hooks=[hooks.WeightUpdateEqualCheck()]).run()
    assert ("snapshot",) not in log and log[1:6] == push(2)  # resumed: the resume push only


def test_first_push_only_on_a_fresh_start():
    log: list = []
    make(log, total=1, extra_hooks=[hooks.FirstPush("--check-precision")]).run()
    assert log[:6] == [*push(0), ("start", 0, 0)]
    log.clear()
    make(log, total=3, resumed=1, extra_hooks=[hooks.FirstPush("--check-precision")]).run()
    assert [c for c in log if c[0] == "push"] == [("push", 2), ("push", 3)]


def test_a_restarted_engine_reconnects_the_trainer_before_the_push():
    log: list = []
    make(log, engines=FakeEngines(log, down_at_push={2})).run()
    i = log.index(("restart",))
    # It gets the weights with the push and takes requests only after it.
    assert log[i - 1 : i + 7] == [
        ("sleep", True),
        ("restart",),
        ("resume", ("weights",)),
        ("connect", ("http://e0-restart2",)),
        ("push", 2),
        ("sleep", False),
        ("resume", ("kv_cache", "cuda_graph")),
        ("admit", "http://e0-restart2"),
    ]


def test_a_push_that_fails_on_a_dead_engine_is_done_again_after_the_probe():
    log: list = []
    loop = make(log, total=1, engines=FakeEngines(log, down_after_failed_push=True))
    assert isinstance(loop.train, FakeTrain)
    loop.train.failing_pushes = 1
    loop.run()
    i = log.index(("probe",))
    assert log[i - 1 : i + 7] == [
        ("push", 1),
        ("probe",),
        ("resume", ("weights",)),
        ("connect", ("http://e0-restarted",)),
        ("push", 1),
        ("sleep", False),
        ("resume", ("kv_cache", "cuda_graph")),
        ("admit", "http://e0-restarted"),
    ]


def test_a_push_that_fails_with_every_engine_up_fails_the_job():
    log: list = []
    loop = make(log, total=1)
    assert isinstance(loop.train, FakeTrain)
    loop.train.failing_pushes = 1
    with pytest.raises(RuntimeError, match="connection lost"):
        loop.run()
    assert ("push", 1) in log and ("probe",) not in log


def test_engines_restarted_during_a_generation_get_the_weights_before_requests():
    log: list = []
    engines = FakeEngines(log)
    loop = make(log, total=1, engines=engines)
    engines.urls, engines.joining = ["http://e0-new"], {0: "http://e0-new"}
    loop.heal()
    assert log == [
        ("sleep", True),
        ("connect", ("http://e0-new",)),
        ("push", 0),
        ("sleep", False),
        ("admit", "http://e0-new"),
    ]


def test_a_failing_hook_after_training_stops_the_step_before_the_push():
    class Gate(Hook):
        def after_train(self, loop, step):
            raise RuntimeError("gate failed")

    log: list = []
    with pytest.raises(RuntimeError, match="gate failed"):
        make(log, extra_hooks=[Gate()]).run()
    assert log[-1] == ("train", 0) and not any(c[0] == "push" for c in log)


def test_samples_without_a_weight_version_are_not_checked_for_staleness(caplog):
    from slime.loop.core import SYNC
    from slime.utils.rollout_batch import Rollout

    rollout = Rollout(4, {}, 2, (None, "3"))  # an SFT sample (no engine) beside a generated one
    with caplog.at_level("WARNING"):
        SYNC.check_staleness(rollout, 3)
    assert "rollout 4 has samples without a weight version" in caplog.text
    with pytest.raises(RuntimeError, match="weight_version 2 while the trainer is at 3"):
        SYNC.check_staleness(Rollout(4, {}, 2, (None, "2")), 3)


def test_the_progress_line_shows_the_steps_throughput():
    from slime.loop.hooks import short_summary

    line = short_summary(
        {"time/step": 2.0, "perf/actor_train_tok_per_s": 1500.0, "perf/actor_train_mfu": 0.25}
    )
    assert line == "step=2 train_tok/s=1500 mfu=0.25"
    assert "mfu" not in short_summary({"time/step": 2.0, "perf/actor_train_tok_per_s": 1500.0})  # CPU: none
