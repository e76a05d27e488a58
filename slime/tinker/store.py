"""The `tinker://` checkpoint store: `tinker://<run>/<kind>/<name>` is the directory
`<store>/<run>/<kind>/<name>/` (run: the training model's id; kind: `weights` for save_state,
`sampler_weights` for save_weights_for_sampler). On disk, so it survives a server restart.

A checkpoint directory holds `meta.json` (the base model's name, the LoRA config, the alpha),
`adapter/` (a PEFT adapter directory: PeftModel.from_pretrained loads it on the base model) and,
for a state saved with its optimizer, `state/` (the FSDP actor's checkpoint of the adapters and
their AdamW moments). A directory is written under a temporary name and renamed when complete.

The weights of save_weights_and_get_sampling_client are no checkpoint the client can name: they
go to `<store>/<run>/.ephemeral/sampler-<seq>/`, which no `tinker://` path reaches and no listing
shows. A run keeps its last `KEEP_EPHEMERAL` of them (an RL loop saves one per step) and loses
them all when its session ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from slime.tinker.errors import TinkerNotFound, TinkerUserError
from slime.utils.files import staged_directory

PREFIX = "tinker://"
KINDS = ("weights", "sampler_weights")
EPHEMERAL = ".ephemeral"
KEEP_EPHEMERAL = 8
"""The unnamed sampler weights a run keeps (the newest)."""


@dataclass(frozen=True)
class Checkpoint:
    run: str
    kind: str
    name: str
    directory: str

    @property
    def uri(self) -> str:
        return f"{PREFIX}{self.run}/{self.kind}/{self.name}"

    @property
    def mtime(self) -> float:
        return os.path.getmtime(os.path.join(self.directory, "meta.json"))

    @property
    def size_bytes(self) -> int:
        return sum(
            os.path.getsize(os.path.join(root, f))
            for root, _, files in os.walk(self.directory)
            for f in files
        )

    def meta(self) -> dict[str, Any]:
        with open(os.path.join(self.directory, "meta.json")) as f:
            return dict(json.load(f))


class Store:
    def __init__(self, root: str):
        self.root = os.path.realpath(root)
        self.logs = os.path.join(self.root, ".logs")
        """The sampling engines' logs."""
        os.makedirs(self.logs, exist_ok=True)

    def checkpoint(self, run: str, kind: str, name: Any) -> Checkpoint:
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise TinkerUserError(f"checkpoint name {name!r}: give a non-empty name without '/'")
        return Checkpoint(run, kind, name, self._inside(run, kind, name))

    def ephemeral(self, run: str, seq: int) -> Checkpoint:
        """Where save_weights_and_get_sampling_client's weights of sampler `seq` go."""
        name = f"sampler-{seq}"
        return Checkpoint(run, "sampler_weights", name, self._inside(run, EPHEMERAL, name))

    def prune_ephemeral(self, run: str, keep: int = KEEP_EPHEMERAL) -> None:
        """All but the run's newest `keep` unnamed sampler weights go."""
        folder = os.path.join(self.root, run, EPHEMERAL)
        names = os.listdir(folder) if os.path.isdir(folder) else []
        done = sorted(
            (int(n.split("-")[1]), n) for n in names if n.startswith("sampler-") and n[8:].isdigit()
        )
        gone = [n for _, n in (done[:-keep] if keep else done)]
        gone += [n for n in names if n.startswith(".") and not keep]  # (a save's staging, cut short)
        for name in gone:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)

    def _inside(self, *parts: str) -> str:
        """The path of `parts` under the store, refused when it would leave it."""
        path = os.path.realpath(os.path.join(self.root, *parts))
        if not path.startswith(self.root + os.sep):
            raise TinkerUserError(f"{'/'.join(parts)!r} is not a checkpoint of this store")
        return path

    def find(self, uri: Any) -> Checkpoint:
        """The checkpoint a `tinker://` path names; refused by name when malformed or absent."""
        if not isinstance(uri, str) or not uri.startswith(PREFIX):
            raise TinkerUserError(f"path {uri!r}: a checkpoint path starts with {PREFIX}")
        parts = uri[len(PREFIX) :].split("/")
        if len(parts) != 3 or parts[1] not in KINDS or not all(parts) or ".." in parts:
            raise TinkerUserError(f"path {uri!r}: expected {PREFIX}<run>/<weights|sampler_weights>/<name>")
        found = Checkpoint(parts[0], parts[1], parts[2], self._inside(*parts))
        if not os.path.isfile(os.path.join(found.directory, "meta.json")):
            raise TinkerNotFound(f"path {uri!r}: no such checkpoint in this server's store ({self.root})")
        return found

    @staticmethod
    @contextlib.contextmanager
    def written(target: Checkpoint, overwrite: bool, meta: dict[str, Any]) -> Iterator[str]:
        """A directory to save `target` into, with `meta` as its meta.json, which becomes `target`
        whole when the block ends (slime.utils.files.staged_directory: a hidden staging directory
        beside it). Refused when `target` exists and not `overwrite`."""
        if os.path.exists(target.directory) and not overwrite:
            raise TinkerUserError(f"{target.uri} exists already: save under another name, or with overwrite")
        with staged_directory(target.directory) as staging:
            yield staging
            with open(os.path.join(staging, "meta.json"), "w") as f:
                json.dump(meta, f, indent=1, sort_keys=True)

    def runs(self) -> list[str]:
        """The runs with a checkpoint on disk."""
        return sorted(
            d
            for d in os.listdir(self.root)
            if not d.startswith(".") and os.path.isdir(os.path.join(self.root, d))
        )

    def checkpoints(self, run: str) -> list[Checkpoint]:
        """A run's complete checkpoints (a directory with its meta.json), oldest first."""
        out = []
        for kind in KINDS:
            folder = os.path.join(self.root, run, kind)
            for name in os.listdir(folder) if os.path.isdir(folder) else []:
                found = Checkpoint(run, kind, name, os.path.join(folder, name))
                if not name.startswith(".") and os.path.isfile(os.path.join(found.directory, "meta.json")):
                    out.append(found)
        return sorted(out, key=lambda c: c.mtime)
