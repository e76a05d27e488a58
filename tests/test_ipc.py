"""slime.utils.flattened_bucket (and slime.bridge.ipc): SGLang's flattened-bucket payload, shared by handle
(CPU: by shared-memory
file; the CUDA-IPC handle itself needs a GPU and is tested in tests/test_engine_gpu.py)."""

from __future__ import annotations

import base64
import io
import os
import pickle

import pytest
import torch

from slime.utils.flattened_bucket import deserialize, flatten, serialize
from slime.utils.shm_tensors import SharedBuffer


def test_a_bucket_of_mixed_dtypes_round_trips_by_handle():
    bucket = [
        ("a.weight", torch.randn(3, 5)),
        ("b.bias", torch.randn(7).to(torch.bfloat16)),
        ("c.scale", torch.arange(6, dtype=torch.int32).reshape(2, 3)),
        ("d", torch.randn(4, 2).t()),
    ]
    shared = SharedBuffer.create(4096)
    try:
        flat, meta = flatten(bucket, shared.data)
        # SGLang's FlattenedTensorBucket layout: byte offsets, one buffer for all dtypes; each tensor
        # starts 16-byte aligned (the int32 after 14 bytes of bfloat16 could not be viewed otherwise).
        assert [(m.start_idx, m.end_idx) for m in meta] == [(0, 60), (64, 78), (80, 104), (112, 144)]
        payload = serialize(flat, meta, sglang_reductions=False, shared_path=shared.path)
        assert len(payload) < 1000  # a handle, not the bytes
        got = deserialize(payload)
        assert [n for n, _ in got] == [n for n, _ in bucket]
        for (_, want), (_, have) in zip(bucket, got, strict=True):
            assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want)
        flat[:4] = 0  # the engine's tensors are views of the trainer's buffer: shared, not copied
        assert deserialize(payload)[0][1].flatten()[0].item() == 0.0
    finally:
        shared.close()


def test_a_payload_that_calls_anything_else_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    payload = base64.b64encode(pickle.dumps({"flattened_tensor": Evil(), "metadata": []})).decode()
    with pytest.raises(ValueError, match=r"may not contain posix\.system"):
        deserialize(payload)
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(ValueError, match="not a flattened_bucket payload"):
        deserialize("not base64 at all!")
    buf = io.BytesIO()
    pickle.dump({"flattened_tensor": torch.zeros(2)}, buf)  # by value: torch.storage._load_from_bytes
    with pytest.raises(ValueError, match="may not contain"):
        deserialize(base64.b64encode(buf.getvalue()).decode())
