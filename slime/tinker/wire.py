"""The Tinker SDK's protobuf messages, as this server reads and writes them.

Since SDK 0.25 a forward or forward_backward request, and the results of forward,
forward_backward and sample, travel as protobuf (`tinker.proto.tinker_public_pb2`, the message
classes of the installed `tinker` package: imported, not copied); everything else is JSON.

- A datum's model input is a list of chunks, of which this server takes encoded text (int32
  little-endian token ids) and refuses images by name.
- A tensor (`loss_fn_inputs`) is dense bytes in its dtype (float32, int64) with a shape, or
  sparse CSR (values, int64 row pointers and columns).
- A forward_backward result holds, per datum, the loss function's outputs (`logprobs`, one per
  target token) as an ArrayRecord: each field one byte buffer for all the datums and the byte
  offsets where each datum's part starts; and metrics named `<name>:<reduction>`, which the SDK
  combines over chunks by the reduction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from slime.tinker.errors import TinkerUserError

_DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}


def pb() -> Any:
    """The installed SDK's message module (`pip install "slime[tinker]"`)."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:  # pragma: no cover - the extra is missing
        raise RuntimeError(
            "the Tinker service needs the tinker SDK's message classes: pip install 'slime[tinker]'"
        ) from e
    return tinker_public_pb2


@dataclass
class Datum:
    """One training example: the input tokens and the loss function's inputs by name."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class ForwardBackward:
    """A decoded forward / forward_backward request."""

    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool


def parse_forward_backward(body: bytes) -> Any:
    """The ForwardBackwardRequest message (its model_id and seq_id read before the data is
    checked: a request refused for its data still uses up its seq_id)."""
    message = pb().ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise TinkerUserError(f"forward_backward: the body is not a ForwardBackwardRequest ({e})") from None
    return message


def decode_forward_backward(message: Any) -> ForwardBackward:
    config: dict[str, float | str] = dict(message.loss_fn_config)
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.number if value.WhichOneof("value") == "number" else value.text
    data = [_datum(i, d) for i, d in enumerate(message.data)]
    return ForwardBackward(
        message.model_id, message.seq_id, data, message.loss_fn, config, message.forward_only
    )


def _datum(index: int, datum: Any) -> Datum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise TinkerUserError(
                f"datum {index}: a model_input chunk of type {kind!r} is not served here (text only: "
                "encoded_text chunks)"
            )
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
    if not tokens:
        raise TinkerUserError(f"datum {index}: its model_input holds no tokens")
    inputs = {
        name: tensor(f"datum {index}: loss_fn_inputs[{name!r}]", t)
        for name, t in datum.loss_fn_inputs.items()
    }
    for name, value in inputs.items():
        if value.shape != (len(tokens),):
            raise TinkerUserError(
                f"datum {index}: loss_fn_inputs[{name!r}] has shape {list(value.shape)}; it needs one value "
                f"per input token ({len(tokens)})"
            )
    targets = inputs.get("target_tokens")
    if targets is not None and not (np.isfinite(targets).all() and (targets == np.round(targets)).all()):
        raise TinkerUserError(
            f"datum {index}: loss_fn_inputs['target_tokens'] must hold token ids (integers)"
        )
    return Datum(tokens, inputs)


def tensor(what: str, t: Any) -> np.ndarray:
    """A dense numpy array of a Tensor message (dense or sparse CSR)."""
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise TinkerUserError(f"{what}: dtype {t.dtype} is not served (float32, int64, int32)")
    shape = tuple(t.shape)
    try:
        if t.WhichOneof("encoding") == "sparse_csr":
            csr = t.sparse_csr
            values = np.frombuffer(csr.values, dtype=dtype)
            rows = np.frombuffer(csr.crow_indices, dtype="<i8")
            cols = np.frombuffer(csr.col_indices, dtype="<i8")
            dense = np.zeros(shape, dtype=dtype)
            for r in range(len(rows) - 1):
                dense[r, cols[rows[r] : rows[r + 1]]] = values[rows[r] : rows[r + 1]]
            return dense
        flat = np.frombuffer(t.dense, dtype=dtype).copy()  # (writable, for torch)
        return flat.reshape(shape) if shape else flat
    except (ValueError, IndexError) as e:
        raise TinkerUserError(f"{what}: its data does not fit its shape {list(shape)} ({e})") from None


def forward_backward_output(per_datum: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """The ForwardBackwardOutput of the loss function's outputs per datum (each a dict of 1-D
    arrays, float32) and the metrics."""
    out = pb().ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add()
    record.num_datums = len(per_datum)
    for name in per_datum[0] if per_datum else []:
        parts = [np.ascontiguousarray(d[name], dtype="<f4") for d in per_datum]
        field = record.fields[name]
        field.dtype = pb().DTYPE_FLOAT32
        field.data = b"".join(p.tobytes() for p in parts)
        field.offsets = np.cumsum([0] + [p.nbytes for p in parts], dtype="<i8").tobytes()
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()
