"""--update-weight-mode delta: versions published on disk, pulled into an engine host's local
checkpoint by the torch engine's /pull_weights and reloaded; the engine's weights equal the
trainer's bitwise after every push, late hosts catch up, re-applied versions converge, and a
corrupted version is refused by its checksum while the previous one keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from slime.bridge.bridge import WeightBridge
from slime.bridge.delta import DeltaDiskTransport
from slime.engines.client import EngineClient, EngineError
from slime.utils import weight_delta as wd
from slime.utils.checksum import tensor_checksum

pytest.importorskip("zstandard")


@pytest.mark.parametrize("encoding", wd.ENCODINGS)
@pytest.mark.parametrize("algorithm", wd.CHECKSUMS)
def test_encode_apply_round_trip_and_checksums(encoding, algorithm):
    rng = np.random.default_rng(0)
    old = rng.integers(0, 256, 4096, dtype=np.uint8)
    new = old.copy()
    new[rng.choice(4096, 100, replace=False)] ^= 0x5A
    blob = wd.encode(encoding, old, new)
    assert blob is not None and len(blob) < new.size
    assert np.array_equal(wd.apply(encoding, old, blob), new)
    assert wd.encode(encoding, old, old.copy()) is None
    assert wd.checksum(algorithm, new) == wd.checksum(algorithm, new.copy())
    assert wd.checksum(algorithm, new) != wd.checksum(algorithm, old)
    if encoding == "overwrite":  # idempotent: applied to the new bytes it changes nothing
        assert np.array_equal(wd.apply(encoding, new, blob), new)


def _trained(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """The weights after an RL step: most tensors move a little, a few stay."""
    g = torch.Generator().manual_seed(step)
    out = {}
    for i, (name, t) in enumerate(state.items()):
        if (i + step) % 5 == 0:
            out[name] = t
        else:
            out[name] = t + 1e-3 * torch.randn(t.shape, generator=g).to(t.dtype)
    return out


def _engine_matches(url: str, state: dict[str, torch.Tensor]) -> list[str]:
    async def ask():
        async with EngineClient(url) as c:
            return await c.weights_checksum()

    got = asyncio.run(ask())["checksums"]
    return [n for n, t in state.items() if got.get(n) != tensor_checksum(t)]


def _push(bridge: WeightBridge, state: dict[str, torch.Tensor], version: int) -> None:
    items = list(state.items())
    half = len(items) // 2
    asyncio.run(bridge.push([items[:half], items[half:]], str(version)))


def test_twenty_delta_pushes_keep_the_engine_bitwise_equal_and_late_hosts_catch_up(
    engine, tiny_model, tmp_path
):
    disk, local = str(tmp_path / "shared"), str(tmp_path / "host-a")
    transport = DeltaDiskTransport(tiny_model, disk, local, "xor", "xxh3-128")
    bridge = WeightBridge(transport, [engine.url])
    state = load_file(os.path.join(tiny_model, "model.safetensors"))
    full_bytes = sum(t.numel() * t.element_size() for t in state.values())
    for step in range(1, 21):
        state = _trained(state, step)
        _push(bridge, state, step)
        assert transport.stats["bytes"] < full_bytes
        assert _engine_matches(engine.url, state) == [], f"push {step}"
    assert sorted(os.listdir(disk)) == [f"weight_v{v:06d}" for v in range(1, 21)]
    index = json.load(open(os.path.join(disk, "weight_v000020", wd.INDEX)))
    assert index["metadata"] == {
        "version": "000020",
        "base_version": "000019",
        "delta_encoding": "xor",
        "compression_format": "zstd",
        "checksum_format": "xxh3-128",
    }
    # A host that joins late seeds from the engine's model (version 0) and applies all 20.
    late = str(tmp_path / "host-b")
    done = wd.pull_weights(late, disk, 20, tiny_model)
    assert done["seeded_from"] == 0 and wd.local_version(late) == 20
    files = load_file(os.path.join(late, "model.safetensors"))
    assert all(torch.equal(files[n], t) for n, t in state.items())
    # A version applied again (the state marker lost after a crash), with one tensor half way
    # back at its older bytes: the pull converges on version 20, writing only that tensor.
    name = next(iter(index["weight_map"]))
    v19 = _bytes_before(late, disk, name)
    loc = wd.tensor_locations(late)[name]
    with open(loc[0], "r+b") as f:
        f.seek(loc[1])
        f.write(v19.tobytes())
    wd._set_local_version(late, 19)
    done = wd.pull_weights(late, disk, 20, tiny_model)
    assert done["tensors_applied"] == 1 and done["tensors_already"] == len(index["weight_map"]) - 1
    files = load_file(os.path.join(late, "model.safetensors"))
    assert all(torch.equal(files[n], t) for n, t in state.items())
    asyncio.run(bridge.close())


def _bytes_before(local: str, disk: str, name: str) -> np.ndarray:
    """`name`'s bytes at version 19, from version 20's xor delta applied to its bytes at 20."""
    from safetensors import safe_open

    vdir = wd.version_dir(disk, 20)
    file = wd.read_index(vdir)["weight_map"][name]
    with safe_open(os.path.join(vdir, file), framework="numpy") as f:
        blob = f.get_tensor(name).tobytes()
    return wd.apply("xor", wd.read_tensor_bytes(wd.tensor_locations(local)[name]), blob)


def test_overwrite_deltas_converge_and_a_corrupted_version_is_refused(
    engine, tiny_model, tmp_path, monkeypatch
):
    disk, local = str(tmp_path / "shared"), str(tmp_path / "host")
    transport = DeltaDiskTransport(tiny_model, disk, local, "overwrite", "blake3")
    bridge = WeightBridge(transport, [engine.url])
    state = load_file(os.path.join(tiny_model, "model.safetensors"))
    for step in range(1, 4):
        state = _trained(state, step)
        _push(bridge, state, step)
    assert _engine_matches(engine.url, state) == []
    # overwrite applied twice: nothing to write, the same bytes
    wd._set_local_version(local, 2)
    again = wd.pull_weights(local, disk, 3, tiny_model)
    assert again["tensors_applied"] == 0 and again["tensors_already"] > 0
    # Storage corrupts version 4 (its deltas are not the checksummed bytes): the engine refuses it.
    real = wd.encode

    def corrupted(encoding, old, new):
        blob = real(encoding, old, new)
        return None if blob is None else real(encoding, old, np.bitwise_not(new))

    monkeypatch.setattr(wd, "encode", corrupted)
    with pytest.raises(EngineError, match="does not match its blake3 checksum"):
        _push(bridge, _trained(state, 4), 4)
    assert _engine_matches(engine.url, state) == []  # version 3 keeps serving

    async def version():
        async with EngineClient(engine.url) as c:
            return await c.get_weight_version()

    assert str(asyncio.run(version())) == "3"
    # The next push starts a fresh stream from the checkpoint and reaches the trainer's weights.
    monkeypatch.setattr(wd, "encode", real)
    state = _trained(state, 5)
    _push(bridge, state, 5)
    assert _engine_matches(engine.url, state) == [] and sorted(os.listdir(disk)) == ["weight_v000001"]
    asyncio.run(bridge.close())


def test_a_host_seeds_from_the_newest_full_version(tiny_model, tmp_path):
    disk = str(tmp_path / "shared")
    full = wd.version_dir(disk, 3)
    shutil.copytree(tiny_model, full)
    state = load_file(os.path.join(full, "model.safetensors"))
    index = {"metadata": {"version": "000003"}, "weight_map": dict.fromkeys(state, "model.safetensors")}
    with open(os.path.join(full, wd.INDEX), "w") as f:
        json.dump(index, f)
    done = wd.pull_weights(str(tmp_path / "host"), disk, 3, "/nonexistent")
    assert done["seeded_from"] == 3 and wd.local_version(str(tmp_path / "host")) == 3


def test_a_local_checkpoint_never_overwrites_files_it_did_not_write(tiny_model, tmp_path):
    with pytest.raises(wd.DeltaError, match="is the engine's model"):
        wd.pull_weights(tiny_model, str(tmp_path / "shared"), 0, tiny_model)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "model.safetensors").write_bytes(b"precious")
    with pytest.raises(wd.DeltaError, match="did not write"):
        wd.pull_weights(str(occupied), str(tmp_path / "shared"), 0, tiny_model)
    assert (occupied / "model.safetensors").read_bytes() == b"precious"


def test_pushed_tensors_take_the_checkpoints_dtype_and_a_stream_removes_only_its_own_files(
    tiny_model, tmp_path
):
    from safetensors.torch import save_file

    bf16 = tmp_path / "bf16"
    shutil.copytree(tiny_model, bf16)
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(bf16 / "model.safetensors")).items()}
    save_file(state, str(bf16 / "model.safetensors"), {"format": "pt"})
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "notes.txt").write_text("someone else's")
    transport = DeltaDiskTransport(str(bf16), str(shared), str(tmp_path / "host"))
    trained = {k: v.float() + 0.01 for k, v in state.items()}  # a float32 trainer's weights
    asyncio.run(transport.setup([]))
    asyncio.run(transport.send([], list(trained.items()), "1"))
    asyncio.run(transport.finish([], "1"))
    wd.pull_weights(str(tmp_path / "host"), str(shared), 1, str(bf16))
    host = load_file(str(tmp_path / "host" / "model.safetensors"))
    assert all(torch.equal(host[k], v.to(torch.bfloat16)) for k, v in trained.items())
    assert (shared / "notes.txt").read_text() == "someone else's"
    fresh = DeltaDiskTransport(str(bf16), str(shared), str(tmp_path / "host"))
    asyncio.run(fresh.setup([]))  # a new stream: the old versions go, the other files stay
    assert sorted(os.listdir(shared)) == ["notes.txt"]
    with pytest.raises(wd.DeltaError, match="has shape"):
        asyncio.run(fresh.send([], [(next(iter(state)), torch.zeros(3))], "2"))
