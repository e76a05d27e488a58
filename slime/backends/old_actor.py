"""--keep-old-actor: the old policy's log-probs from the weights that generated the rollout.

Each rank keeps its part of the weights of every version it pushes (in host memory, the last
three: one step off-policy and --update-weights-interval need the one before the newest), and
the log-prob pass of a rollout runs with the version its samples report. Synchronously that is
the weights being trained; one step off (train_async.py) it is the version before (slime keeps
a queue of two copies rotated at each push, which lags one step more in train.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from slime.utils.batch import BatchError, RolloutBatch

KEPT = 3


def keep_weights(actor: Any, version: str) -> None:
    """The actor's weights as pushed as `version`, kept (a copy of its part, on the host)."""
    kept: dict[str, dict[str, torch.Tensor]] = actor.__dict__.setdefault("kept", {})
    kept[version] = {k: v.detach().to("cpu", copy=True) for k, v in actor._snapshot().items()}
    for old in list(kept)[:-KEPT]:
        del kept[old]


def generating_weights(
    actor: Any, batch: RolloutBatch, mine: list[int]
) -> contextlib.AbstractContextManager[None]:
    """With --keep-old-actor: the kept weights of the version every sample was generated with,
    agreed over the ranks (BatchError, on all of them, for samples of several versions, of none
    reported, or of one not kept); otherwise nothing."""
    if not actor.cfg.loss.keep_old_actor:
        return contextlib.nullcontext()
    kept = actor.__dict__.get("kept", {})
    local = {batch.weight_versions[p] for p in mine} if batch.weight_versions is not None else {None}
    everyone: list[Any] = [local]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
    versions = set().union(*everyone)
    if len(versions) != 1 or None in versions or next(iter(versions)) not in kept:
        raise BatchError(
            "--keep-old-actor: the rollout's samples come from weight version(s) "
            f"{sorted(map(str, versions))}, the versions kept are {sorted(kept)}: each rollout must come "
            "from one pushed version (not with --fully-async or --partial-rollout, nor from a replayed "
            "dump)"
        )
    return actor._weights_of(kept[next(iter(versions))])  # type: ignore[no-any-return]
