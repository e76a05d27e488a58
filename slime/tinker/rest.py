"""The REST listing of Tinker's training runs and checkpoints (the SDK's RestClient, which
tinker-cookbook reads), from the store on disk and the live models: a run is a training model's
id; its checkpoints are the store's."""

from __future__ import annotations

import datetime
import shutil
from typing import Any

from slime.tinker.errors import TinkerNotFound
from slime.tinker.service import Service
from slime.tinker.store import Checkpoint

OWNER = "local"


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat()


def checkpoint(c: Checkpoint) -> dict[str, Any]:
    return {
        "checkpoint_id": f"{c.kind}/{c.name}",
        "checkpoint_type": "training" if c.kind == "weights" else "sampler",
        "time": _iso(c.mtime),
        "tinker_path": c.uri,
        "size_bytes": c.size_bytes,
        "public": False,
    }


def training_run(service: Service, run: str) -> dict[str, Any]:
    saved = service.store.checkpoints(run)
    live = service.models.get(run)
    if live is None and not saved:
        raise TinkerNotFound(f"unknown training run {run!r}")
    meta = saved[-1].meta() if saved else {}
    base = live.base_model if live is not None else meta["base_model"]
    rank = live.spec.rank if live is not None else meta["lora_config"]["rank"]
    last = [c for c in saved if c.kind == "weights"]
    last_sampler = [c for c in saved if c.kind == "sampler_weights"]
    times = [c.mtime for c in saved] + ([live.created] if live is not None else [])
    return {
        "training_run_id": run,
        "base_model": base,
        "model_owner": OWNER,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": rank,
        "last_request_time": _iso(max(times)),
        "last_checkpoint": checkpoint(last[-1]) if last else None,
        "last_sampler_checkpoint": checkpoint(last_sampler[-1]) if last_sampler else None,
    }


def training_runs(service: Service, query: dict[str, str]) -> dict[str, Any]:
    runs = sorted(set(service.store.runs()) | set(service.models))
    limit, offset = int(query.get("limit", 20)), int(query.get("offset", 0))
    page = [training_run(service, r) for r in runs[offset : offset + limit]]
    return {"training_runs": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}


def run_checkpoints(service: Service, run: str) -> dict[str, Any]:
    saved = service.store.checkpoints(run)
    if run not in service.models and not saved:
        raise TinkerNotFound(f"unknown training run {run!r}")
    return {"checkpoints": [checkpoint(c) for c in saved], "cursor": None}


def all_checkpoints(service: Service, query: dict[str, str]) -> dict[str, Any]:
    found = [c for run in service.store.runs() for c in service.store.checkpoints(run)]
    limit, offset = int(query.get("limit", 100)), int(query.get("offset", 0))
    page = [checkpoint(c) for c in found[offset : offset + limit]]
    return {"checkpoints": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(found)}}


def weights_info(service: Service, body: dict[str, Any]) -> dict[str, Any]:
    meta = service.store.find(body.get("tinker_path")).meta()
    lora = meta["lora_config"]
    return {
        "base_model": meta["base_model"],
        "is_lora": True,
        "lora_rank": lora["rank"],
        "train_unembed": lora["train_unembed"],
        "train_mlp": lora["train_mlp"],
        "train_attn": lora["train_attn"],
    }


def delete_checkpoint(service: Service, run: str, checkpoint_id: str) -> dict[str, Any]:
    found = service.store.find(f"tinker://{run}/{checkpoint_id}")
    shutil.rmtree(found.directory)
    return {}
