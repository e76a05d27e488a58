"""Parameter-sync verification against a real torch engine, for every transport: a clean push
passes all three checks (the online fingerprint check, snapshot/reset/compare, the before/after
dumps with check_sync_parameter) and every injected fault is caught by each, with its lines."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file

from slime.bridge.bridge import WeightBridge
from slime.bridge.faults import PushFault
from slime.bridge.push import push_actor_weights
from slime.bridge.topology import build_topology
from slime.bridge.verify import WeightSyncError
from slime.engines.client import EngineClient, EngineError
from slime.engines.torch_engine.launcher import start_torch_engine
from slime.tools import check_sync_parameter as checker
from slime.utils.buckets import iter_buckets
from slime.utils.checksum import tensor_fingerprint
from tests.conftest import ENGINE_ARGS

Q0, Q1 = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
O1, NORM = "model.layers.1.self_attn.o_proj.weight", "model.norm.weight"
FAULTS = {
    "clean": None,
    "swap": f"swap:{Q0},{Q1}",  # a wrong name mapping
    "transpose": f"transpose:{O1}",
    "drop": f"drop:{NORM}",  # a tensor left out of the push
    "perturb": f"perturb:{Q0}",  # one element
}
CHANGED = {"clean": set(), "swap": {Q0, Q1}, "transpose": {O1}, "drop": {NORM}, "perturb": {Q0}}


class CheckpointActor:
    """A trainer holding exactly the checkpoint the engine loaded (as at step 0)."""

    pushes_adapter = False

    def __init__(self, model_dir: str):
        self.state = load_file(f"{model_dir}/model.safetensors")

    def export_weights(self, bucket_bytes: int, every_rank: bool = False):
        return iter_buckets(self.state.items(), bucket_bytes)


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("sync-logs") / "engine.log")
    # Parameter dumps may go anywhere under pytest's base directory (each test's tmp_path).
    dumps = str(tmp_path_factory.getbasetemp())
    proc = start_torch_engine(tiny_model, ENGINE_ARGS, log_path=log, debug_dump_dir=dumps)
    yield proc
    proc.stop()


def call(url, method, *args):
    async def go():
        async with EngineClient(url) as c:
            return await getattr(c, method)(*args)

    return asyncio.run(go())


@pytest.mark.parametrize("transport", ["tensor", "distributed", "disk"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_every_check_catches_every_fault(engine, tiny_model, tmp_path, transport, fault, capsys):
    actor = CheckpointActor(tiny_model)
    bridge = WeightBridge.for_topology(build_topology(transport, "cpu", [engine.url]), tiny_model)
    spec = FAULTS[fault]
    push_fault = PushFault.parse(spec) if spec else None
    try:
        call(engine.url, "dump_parameters", str(tmp_path / "before_sync_parameter" / "0"))
        call(engine.url, "weights_checker", "snapshot")
        call(engine.url, "weights_checker", "reset_tensors")
        # 1. The online check, on the push itself (fingerprints taken before the fault).
        if fault == "clean":
            stats = push_actor_weights(actor, bridge, f"{transport}-1", 200_000, push_fault, verify=True)
            assert stats is not None and stats["verify_trainer_seconds"] >= 0
            held = call(engine.url, "weights_fingerprint")["fingerprints"]  # the same numbers on request
            assert {n: v["fingerprint"] for n, v in held.items()} == {
                n: tensor_fingerprint(t) for n, t in actor.state.items()
            }
        else:
            with pytest.raises(WeightSyncError) as e:
                push_actor_weights(actor, bridge, f"{transport}-1", 200_000, push_fault, verify=True)
            kind = "not pushed" if fault == "drop" else "differs"
            assert {line.split(": ")[1].split(" ")[0] for line in str(e.value).splitlines()[1:-1]} == CHANGED[
                fault
            ]
            assert all(f"{kind}: {name}" in str(e.value) for name in CHANGED[fault])
        # 2. Snapshot / reset / compare: the noise left in a dropped tensor shows too.
        if fault == "clean":
            assert call(engine.url, "weights_checker", "compare")["success"] is True
        else:
            with pytest.raises(EngineError) as e:
                call(engine.url, "weights_checker", "compare")
            assert e.value.status == 400 and "check tensor equality failed" in e.value.message
            assert {
                line.split()[0].removeprefix("name=") for line in e.value.message.splitlines()[1:]
            } == CHANGED[fault]
        # 3. The dumps and the checker.
        call(engine.url, "dump_parameters", str(tmp_path / "after_sync_parameter" / "0"))
        code = checker.main(["--root_dir", str(tmp_path)])
        lines = capsys.readouterr().out.splitlines()
        diff = {line.split("|")[2] for line in lines if line.startswith("DIFF|")}
        assert diff == CHANGED[fault] and code == (0 if fault == "clean" else 1)
        n = len(actor.state)
        assert lines[-1] == f"ALL: {n}, PASS: {n - len(diff)}, DIFF: {len(diff)}, MISSING: 0"
    finally:  # leave the module's engine holding the checkpoint
        push_actor_weights(actor, bridge, "restored", 1 << 30)
        asyncio.run(bridge.close())


def test_compare_after_a_bfloat16_push_rounds_the_snapshot_and_still_catches_a_drop(engine, tiny_model):
    """A bfloat16 trainer (Megatron --bf16) pushing into this float32 engine: "compare" holds
    each parameter to the checkpoint rounded to bfloat16, says so, and still sees the noise
    that a tensor left out of the push leaves behind."""
    actor = CheckpointActor(tiny_model)
    actor.state = {n: t.to(torch.bfloat16) for n, t in actor.state.items()}
    assert any(
        not torch.equal(t.float(), v)
        for t, v in zip(actor.state.values(), load_file(f"{tiny_model}/model.safetensors").values())
    )
    bridge = WeightBridge.for_topology(build_topology("tensor", "cpu", [engine.url]), tiny_model)
    try:
        for fault in (None, PushFault.parse(f"drop:{NORM}")):
            call(engine.url, "weights_checker", "snapshot")
            call(engine.url, "weights_checker", "reset_tensors")
            push_actor_weights(actor, bridge, "bf16", 200_000, fault)
            if fault is None:
                message = call(engine.url, "weights_checker", "compare")["message"]
                n = len(actor.state)
                assert message == (
                    f"compare: parameters equal the snapshot ({n} compared with the snapshot "
                    "rounded to bfloat16, the dtype their update arrived in)"
                )
            else:
                with pytest.raises(EngineError) as e:
                    call(engine.url, "weights_checker", "compare")
                lines = e.value.message.splitlines()[1:]
                assert [line.split()[0] for line in lines] == [f"name={NORM}"]
                assert "rounded" not in lines[0]  # not pushed: compared exactly, and noise differs
    finally:
        actor = CheckpointActor(tiny_model)
        push_actor_weights(actor, bridge, "restored", 1 << 30)
        asyncio.run(bridge.close())


def _dump(root, part, rank, tensors):
    folder = root / part / str(rank)
    folder.mkdir(parents=True, exist_ok=True)
    for name, t in tensors.items():
        torch.save(t, folder / name)


def test_checker_lines_counts_and_exit_codes(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(4, 6, generator=g) for _ in range(3))
    moved = a.clone()
    moved[2, 3] += 0.5
    _dump(tmp_path, "before_sync_parameter", 0, {"a": a, "b": b, "extra": c, "shape": torch.zeros(6, 4)})
    _dump(
        tmp_path,
        "after_sync_parameter",
        0,
        {"a": moved, "b": b.clone(), "new": c, "shape": torch.zeros(4, 6)},
    )
    _dump(tmp_path, "before_sync_parameter", 1, {"a": a})
    _dump(tmp_path, "after_sync_parameter", 1, {"a": a.clone()})
    assert checker.main(["--root-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"DIFF|0|a|torch.Size([4, 6])|{torch.tensor(float(moved.double().mean()))!s}|torch.Size([4, 6])|"
        f"{torch.tensor(float(a.double().mean()))!s}|max_abs=0.5|first_index=15"
    )
    assert out[1:] == [
        "PASS|0|b",
        "MISSING_AFTER|0|extra",
        "MISSING_BEFORE|0|new",
        "DIFF|0|shape|torch.Size([4, 6])|tensor(0.)|torch.Size([6, "
        "4])|tensor(0.)|max_abs=n/a|first_index=n/a",
        "PASS|1|a",
        "ALL: 6, PASS: 2, DIFF: 2, MISSING: 2",
    ]
    # Tolerances: within atol the moved element passes; --json for machines.
    assert checker.main(["--root_dir", str(tmp_path), "--atol", "0.6", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["summary"] == {"ALL": 6, "PASS": 3, "DIFF": 1, "MISSING": 2}
    assert [r["status"] for r in report["results"] if r["name"] == "a"] == ["PASS", "PASS"]


def test_checker_passes_only_when_everything_passes_and_refuses_an_empty_dir(tmp_path, capsys):
    names = {f"model.layers.{i}.w": torch.randn(3, 5) for i in range(120)}  # many small files
    _dump(tmp_path, "before_sync_parameter", 0, names)
    _dump(tmp_path, "after_sync_parameter", 0, {n: t.clone() for n, t in names.items()})
    assert checker.main(["--root_dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "ALL: 120, PASS: 120, DIFF: 0, MISSING: 0"
    with pytest.raises(SystemExit) as e:
        checker.main(["--root_dir", str(tmp_path / "nothing")])
    assert e.value.code == 2 and "--debug-sync-parameters-path" in capsys.readouterr().err


def test_chunked_comparison_equals_the_whole_one():
    g = torch.Generator().manual_seed(1)
    before = torch.randn(1000, generator=g)
    after = before.clone()
    after[[17, 503, 999]] += torch.tensor([1e-3, -2.0, 0.25])
    whole = checker.compare_tensors(after, before, 0.0, 0.0)
    for chunk in (1, 7, 64, 999):
        part = checker.compare_tensors(after, before, 0.0, 0.0, chunk=chunk)
        assert part["first_index"] == whole["first_index"] == 17
        assert part["max_abs"] == whole["max_abs"] == pytest.approx(2.0)
        assert part["after_mean"] == pytest.approx(whole["after_mean"], abs=1e-12)
