"""Delta weight sync on disk: the published format and both of its ends (the trainer's encoder,
the engine's /pull_weights), in slime's layout.

A version N is a directory `weight_v{N:06d}/` under --update-weight-disk-dir holding a canonical
Hugging Face checkpoint layout: `model-XXXXX-of-YYYYY.safetensors` files and
`model.safetensors.index.json`, whose "metadata" says what the files hold:

    version, base_version     "000007", "000006"
    delta_encoding            xor: the zstd-compressed bytes new ^ old of each changed tensor;
                              overwrite: count (u4), the changed byte positions (u4 each), the new
                              bytes at them, zstd-compressed; absent: a full checkpoint
    compression_format        zstd
    checksum_format           xxh3-128, blake3 or adler32: each file's safetensors metadata maps
                              every tensor it holds to the checksum of the tensor's new bytes

Deltas are byte-level and dtype-blind (a tensor's raw bytes against its raw bytes in the
previous version). An engine host keeps a full checkpoint in its --update-weight-local-checkpoint-dir
(seeded from the engine's own model, or the newest full version) and patches each version in
place; a tensor is written only once its new bytes match their checksum, and one already at the
new checksum is left alone, so re-applying a version (after a crash half way, or twice) converges
for both encodings, and a corrupted delta is refused before it touches the checkpoint.

xxh3-128 and blake3 come from the xxhash and blake3 packages, adler32 from zlib, zstd from the
zstandard package (`pip install "slime[delta]"`); each is imported where it is used.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np

INDEX = "model.safetensors.index.json"
STATE = "slime_weight_version.json"
"""In a local checkpoint: the version its files hold, written last (a commit marker)."""
OWNED = ".slime_local_checkpoint"
"""In a local checkpoint: made by /pull_weights, which may replace its files (never removed)."""
ENCODINGS = ("xor", "overwrite")
CHECKSUMS = ("xxh3-128", "blake3", "adler32")
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)


class DeltaError(RuntimeError):
    """A version that cannot be applied: missing, of another base, or failing its checksum."""


def within(path: str | None, root: str | None) -> bool:
    """`path` is `root` or lies inside it (symlinks resolved); False when either is not given."""
    if not path or not root:
        return False
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root + os.sep)


def version_dir(root: str, version: int) -> str:
    return os.path.join(root, f"weight_v{version:06d}")


def checksum(algorithm: str, data: Any) -> str:
    """The hex digest of `data` (bytes or a uint8 array)."""
    buf = np.ascontiguousarray(data).data if isinstance(data, np.ndarray) else data
    if algorithm == "xxh3-128":
        import xxhash

        return str(xxhash.xxh3_128_hexdigest(buf))
    if algorithm == "blake3":
        import blake3

        return str(blake3.blake3(buf).hexdigest())
    if algorithm == "adler32":
        import zlib

        return f"{zlib.adler32(buf):08x}"
    raise ValueError(f"unknown checksum {algorithm!r}: choose one of {', '.join(CHECKSUMS)}")


def encode(encoding: str, old: np.ndarray, new: np.ndarray) -> bytes | None:
    """The compressed delta from `old` to `new` (uint8, the same size); None when equal."""
    import zstandard

    if encoding == "xor":
        diff = np.bitwise_xor(old, new)
        if not diff.any():
            return None
        raw = diff.tobytes()
    elif encoding == "overwrite":
        changed = np.flatnonzero(old != new)
        if not changed.size:
            return None
        if new.size >= 1 << 32:
            raise DeltaError("the overwrite encoding's u4 positions address tensors under 4 GiB; use xor")
        raw = b"".join(
            (struct.pack("<I", changed.size), changed.astype("<u4").tobytes(), new[changed].tobytes())
        )
    else:
        raise ValueError(f"unknown delta encoding {encoding!r}: choose one of {', '.join(ENCODINGS)}")
    return bytes(zstandard.ZstdCompressor(level=1).compress(raw))


def apply(encoding: str, current: np.ndarray, blob: bytes) -> np.ndarray:
    """`current` (uint8) with the compressed delta `blob` applied: a new array."""
    import zstandard

    raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=max(16 * current.size + 64, 1 << 20))
    if encoding == "xor":
        if len(raw) != current.size:
            raise DeltaError(f"an xor delta of {len(raw)} bytes for a tensor of {current.size}")
        return np.bitwise_xor(current, np.frombuffer(raw, np.uint8))
    if encoding == "overwrite":
        (count,) = struct.unpack_from("<I", raw)
        positions = np.frombuffer(raw, "<u4", count, 4)
        values = np.frombuffer(raw, np.uint8, count, 4 + 4 * count)
        if count and int(positions.max()) >= current.size:
            raise DeltaError(
                f"an overwrite delta writes byte {int(positions.max())} of a {current.size}-byte tensor"
            )
        out = current.copy()
        out[positions] = values
        return out
    raise DeltaError(f"unknown delta encoding {encoding!r}")


def _headers(ckpt_dir: str) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(file, header size, header) of each safetensors file (8-byte little-endian length, then JSON)."""
    for name in sorted(os.listdir(ckpt_dir)):
        if name.endswith(".safetensors"):
            path = os.path.join(ckpt_dir, name)
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                yield path, size, json.loads(f.read(size))


def tensor_locations(ckpt_dir: str) -> dict[str, tuple[str, int, int]]:
    """Each tensor of the directory's safetensors files: (file, byte offset, byte count)."""
    out: dict[str, tuple[str, int, int]] = {}
    for path, size, header in _headers(ckpt_dir):
        for tensor, info in header.items():
            if tensor != "__metadata__":
                begin, end = info["data_offsets"]
                out[tensor] = (path, 8 + size + begin, end - begin)
    return out


def read_tensor_bytes(location: tuple[str, int, int]) -> np.ndarray:
    path, offset, count = location
    return np.fromfile(path, dtype=np.uint8, count=count, offset=offset)


def read_index(vdir: str) -> dict[str, Any]:
    path = os.path.join(vdir, INDEX)
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DeltaError(f"{path}: cannot be read ({e})") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise DeltaError(f"{path}: not a checkpoint index (no weight_map)")
    return index


def write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---- the engine's side: /pull_weights --------------------------------------------------------
def local_version(local_dir: str) -> int | None:
    try:
        with open(os.path.join(local_dir, STATE)) as f:
            return int(json.load(f)["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _set_local_version(local_dir: str, version: int | None, base: str | None = None) -> None:
    """The marker: the version the files hold (and the model they were seeded from)."""
    path = os.path.join(local_dir, STATE)
    if version is None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    base = base or _local_base(local_dir)
    write_atomic(path, json.dumps({"version": version, "base": base}).encode())


@contextlib.contextmanager
def _host_lock(local_dir: str) -> Iterator[None]:
    """Engines on one host share its local checkpoint: one pull at a time."""
    import fcntl

    with open(os.path.join(local_dir, ".pull.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pull_weights(local_dir: str, source_dir: str, target: int, base_dir: str) -> dict[str, Any]:
    """Bring the host's checkpoint in `local_dir` to version `target` of `source_dir`: seeded from
    the newest full version at or below `target` (`base_dir`, the engine's own model, is version 0)
    when it holds none, an older run's, or a newer one; then each delta applied in turn, every
    tensor checked against its checksum. Returns what was done."""
    for other, what in ((base_dir, "the engine's model"), (source_dir, "the published versions")):
        if within(local_dir, other):
            raise DeltaError(
                f"the local checkpoint directory {local_dir} is {what} ({other}): give a directory of its own"
            )
    os.makedirs(local_dir, exist_ok=True)
    with _host_lock(local_dir):
        current, base = local_version(local_dir), os.path.realpath(base_dir)
        seeded = None
        if (
            current is None
            or current > target
            or (target == 0 and (current != 0 or _local_base(local_dir) != base))
        ):
            seeded = _seed(local_dir, source_dir, target, base)
            current = seeded
        applied = skipped = 0
        for attempt in range(2):
            try:
                for v in range(current + 1, target + 1):
                    done, already = _apply_version(local_dir, version_dir(source_dir, v), v)
                    applied, skipped = applied + done, skipped + already
                break
            except DeltaError:
                if attempt or seeded is not None:  # a fresh copy failed too: the version is corrupt
                    raise
                # The local copy may be what is wrong (a write torn by a crash): seed it afresh once.
                current = seeded = _seed(local_dir, source_dir, target, base)
        return {
            "version": target,
            "seeded_from": seeded,
            "tensors_applied": applied,
            "tensors_already": skipped,
        }


def _seed(local_dir: str, source_dir: str, target: int, base: str) -> int:
    """A fresh copy of the newest full version at or below `target` (0: the engine's model)."""
    seeded = _newest_full(source_dir, target)
    _materialize(local_dir, base if seeded == 0 else version_dir(source_dir, seeded), seeded, base)
    return seeded


def _local_base(local_dir: str) -> str | None:
    try:
        with open(os.path.join(local_dir, STATE)) as f:
            return str(json.load(f).get("base"))
    except (OSError, ValueError, AttributeError):
        return None


def _newest_full(source_dir: str, target: int) -> int:
    for v in range(target, 0, -1):
        vdir = version_dir(source_dir, v)
        if os.path.isfile(os.path.join(vdir, INDEX)) and "delta_encoding" not in read_index(vdir).get(
            "metadata", {}
        ):
            return v
    return 0


def _materialize(local_dir: str, full_dir: str, version: int, base: str | None = None) -> None:
    """Copy a full checkpoint into `local_dir`; the version marker goes first, and comes back last."""
    if not os.path.isdir(full_dir):
        raise DeltaError(f"{full_dir}: the full checkpoint to seed from does not exist")
    foreign = [n for n in os.listdir(local_dir) if n != ".pull.lock"]
    if foreign and not os.path.exists(os.path.join(local_dir, OWNED)):
        raise DeltaError(
            f"{local_dir} holds files /pull_weights did not write ({', '.join(sorted(foreign)[:3])}): give "
            "an empty directory (its files are replaced)"
        )
    open(os.path.join(local_dir, OWNED), "a").close()
    _set_local_version(local_dir, None)
    for name in os.listdir(local_dir):
        if name.endswith(".safetensors"):  # a previous run's shards may be named otherwise
            os.remove(os.path.join(local_dir, name))
    for name in os.listdir(full_dir):
        src = os.path.join(full_dir, name)
        if os.path.isfile(src) and not name.startswith(".") and name != STATE:
            shutil.copyfile(src, os.path.join(local_dir, name))
    _set_local_version(local_dir, version, base)


def _apply_version(local_dir: str, vdir: str, version: int) -> tuple[int, int]:
    """Patch `local_dir` from version-1 to `version`; (tensors written, tensors already there)."""
    from safetensors import safe_open

    index = read_index(vdir)
    meta = index.get("metadata", {})
    if "delta_encoding" not in meta:  # a full version in the chain: copied as it is
        _materialize(local_dir, vdir, version)
        return len(index["weight_map"]), 0
    if int(meta.get("base_version", -1)) != version - 1:
        raise DeltaError(f"{vdir}: its base_version is {meta.get('base_version')}, not {version - 1:06d}")
    encoding, algorithm = meta["delta_encoding"], meta["checksum_format"]
    locations = tensor_locations(local_dir)
    applied = already = 0
    for file in sorted(set(index["weight_map"].values())):
        path = os.path.join(vdir, file)
        with safe_open(path, framework="numpy") as f:
            sums = f.metadata() or {}
            for name in f.keys():
                if name not in locations:
                    raise DeltaError(f"{vdir}: tensor {name} is not in the local checkpoint {local_dir}")
                expected = sums.get(name)
                if expected is None:
                    raise DeltaError(f"{path}: no checksum for {name}")
                current = read_tensor_bytes(locations[name])
                if checksum(algorithm, current) == expected:
                    already += 1  # applied before (a pull that stopped half way, or twice)
                    continue
                try:
                    new = apply(encoding, current, f.get_tensor(name).tobytes())
                except DeltaError:
                    raise
                except Exception as e:  # zstd's or safetensors': the file is damaged
                    raise DeltaError(f"{path}: {name} cannot be decoded ({type(e).__name__}: {e})") from None
                if checksum(algorithm, new) != expected:
                    raise DeltaError(
                        f"{path}: {name} does not match its {algorithm} checksum after the delta: the "
                        "version is corrupt, or the local checkpoint is not at the version it is based on"
                    )
                file_path, offset, _ = locations[name]
                with open(file_path, "r+b") as out:
                    out.seek(offset)
                    out.write(new.tobytes())
                    out.flush()
                    os.fsync(out.fileno())  # on disk before the marker says so
                applied += 1
    _set_local_version(local_dir, version)
    return applied, already


# ---- the trainer's side --------------------------------------------------------------------------
def seed_snapshot(hf_checkpoint: str) -> tuple[dict[str, np.ndarray], dict[str, tuple[str, tuple[int, ...]]]]:
    """The raw bytes of every tensor of the checkpoint the engines start from (what version 1 is a
    delta against), and each tensor's safetensors dtype and shape, from one read of its headers."""
    snapshot, kinds = {}, {}
    for path, size, header in _headers(hf_checkpoint):
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                snapshot[name] = read_tensor_bytes((path, 8 + size + begin, end - begin))
                kinds[name] = (info["dtype"], tuple(info["shape"]))
    return snapshot, kinds


SAFETENSORS_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
"""safetensors' dtype names, as torch names them."""


def owned_entries(disk_dir: str) -> list[str]:
    """What a delta stream wrote in --update-weight-disk-dir (versions, unfinished ones): all that a
    fresh stream removes."""
    if not os.path.isdir(disk_dir):
        return []
    return [n for n in os.listdir(disk_dir) if n.startswith(("weight_v", ".weight_v"))]


def copy_model_files(src: str, dst: str) -> None:
    """The config and tokenizer files of `src`, so `dst` is a complete Hugging Face model."""
    for name in os.listdir(src):
        if name in _MODEL_FILES or name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(os.path.join(src, name), dst)
