"""Shared-memory buffers: a full /dev/shm is a clear error up front, and nothing is left behind."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from slime.utils import shm_tensors
from slime.utils.shm_tensors import SharedBuffer, open_named_tensors, pack_named_tensors, parse_handle


def _segments() -> set[str]:
    return {f for f in os.listdir(shm_tensors.shm_dir()) if f.startswith("slime_weights_")}


def test_pack_and_open_round_trip():
    named = [
        ("a", torch.arange(6, dtype=torch.float32).view(2, 3)),
        ("b", torch.ones(5, dtype=torch.bfloat16)),
    ]
    handle, buf = pack_named_tensors(named)
    try:
        opened = open_named_tensors(parse_handle(handle))
        assert [n for n, _ in opened] == ["a", "b"]
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(named, opened))
    finally:
        buf.close()


@pytest.mark.skipif(shm_tensors.shm_dir() != "/dev/shm", reason="needs a tmpfs /dev/shm")
def test_more_than_dev_shm_holds_is_enospc_naming_size_and_place():
    stat = os.statvfs("/dev/shm")
    too_big = 2 * stat.f_blocks * stat.f_frsize + 2**30  # refused up front, nothing is written
    before = _segments()
    with pytest.raises(OSError) as info:
        SharedBuffer.create(too_big)
    assert info.value.errno == errno.ENOSPC
    assert str(too_big) in str(info.value) and "/dev/shm" in str(info.value)
    assert _segments() == before


def test_segment_removed_when_mapping_fails(monkeypatch):
    def broken_from_file(*args, **kwargs):
        raise RuntimeError("cannot map")

    before = _segments()
    monkeypatch.setattr(shm_tensors.torch, "from_file", broken_from_file)
    with pytest.raises(RuntimeError, match="cannot map"):
        SharedBuffer.create(4096)
    assert _segments() == before


def test_receiver_maps_a_reused_file_once_and_remaps_a_replaced_one(tmp_path):
    from slime.utils.shm_tensors import MappedFiles

    mapped = MappedFiles(max_files=2)
    handle, buffer = pack_named_tensors([("w", torch.arange(6.0))])
    first = mapped.get(buffer.path, buffer.nbytes)
    handle, buffer = pack_named_tensors([("w", torch.arange(6.0) * 2)], buffer)  # the sender reuses it
    assert mapped.get(buffer.path, buffer.nbytes) is first  # no new mapping
    assert torch.equal(open_named_tensors(parse_handle(handle), mapped)[0][1], torch.arange(6.0) * 2)

    # The same path now names another file (another inode): mapped again, new bytes seen.
    path = buffer.path
    buffer.close()
    with open(path, "wb") as f:
        f.write(torch.full((6,), 7.0).numpy().tobytes())
    assert torch.equal(mapped.get(path, 24)[:24].view(torch.float32), torch.full((6,), 7.0))

    # Files the sender removed are let go at the next request; at most max_files stay mapped.
    os.unlink(path)
    others = [pack_named_tensors([("w", torch.ones(2))])[1] for _ in range(3)]
    for b in others:
        mapped.get(b.path, b.nbytes)
    assert len(mapped._maps) == 2 and path not in mapped._maps
    for b in others:
        b.close()
