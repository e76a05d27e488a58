"""The train ranks (TrainRank actors) as one TrainGroup (slime.loop.parts)."""

from __future__ import annotations

import logging
import os
from typing import Any, NoReturn

import ray

from slime.config.arguments import Config
from slime.loop.parts import EngineGroup, TrainRankDied
from slime.ray.waiting import RolloutBar, wait_refs
from slime.utils.rollout_batch import Rollout, TrainOutput

logger = logging.getLogger(__name__)


def _dead_ranks(refs: list[Any], grace_s: float = 10.0) -> tuple[list[int], bool]:
    """The ranks whose call ended because their process died (given `grace_s` to be reported,
    while any call runs), and whether any call still runs after that."""
    ray.wait(refs, num_returns=len(refs), timeout=grace_s)
    dead, stuck = [], False
    for r, ref in enumerate(refs):
        if not ray.wait([ref], timeout=0)[0]:
            stuck = True
            continue
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            dead.append(r)
        except Exception:
            pass
    return dead, stuck


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(e).__name__


ByPart = dict[int, list[Any]]
"""Per data-parallel part, the object references its ranks answered with (PPO's values, returns)."""


class RayTrainGroup:
    """Every call reaches every rank; each rank is handed its data-parallel replica's part of a
    rollout by reference (Ray resolves it in the rank's process, never in the driver)."""

    def __init__(
        self,
        ranks: list[Any],
        infos: list[dict[str, Any]],
        config: Config,
        log_dir: str,
        progress: RolloutBar,
        critic: bool = False,
    ):
        self.ranks, self.config, self.log_dir, self.progress = ranks, config, log_dir, progress
        self.critic = critic  # PPO's critic ranks: their hang dumps are criticrank{r}.txt
        self.offload = config.cluster.offload
        self.hung = False  # a rank is stuck or dead: close() kills the ranks instead of asking them
        self.transport: str | None = None  # the push's transport as it runs, once connected
        self.connected: tuple[tuple[str, ...], int] = ((), -1)  # (engine addresses, the engines' changes)
        self.dp_ranks = [int(info.get("dp_rank", r)) for r, info in enumerate(infos)]
        self.resumed_rollout_id: int | None = infos[0]["resumed_rollout_id"]
        self.resumed_data_state: dict[str, int] | None = (infos[0]["resumed_extra"] or {}).get("data")

    def train(self, rollout: Rollout, values: ByPart | None = None, update: bool = True) -> TrainOutput:
        """Rank 0's output. PPO: `values` are the critic's answers (references, by data-parallel
        part: each rank fetches only its part's); the output's `returns` are then every rank's
        (references by part), for the critic."""
        self._check_parts(rollout)
        refs = [
            rank.train.remote(
                rollout.rollout_id, rollout.parts[d], None if values is None else values.get(d, []), update
            )
            for rank, d in zip(self.ranks, self.dp_ranks)
        ]
        outputs = self._wait(refs, f"the train step of rollout {rollout.rollout_id}", "train")
        output = outputs[0]
        if values is not None:
            output.returns = self._by_part([o.returns for o in outputs])
        return output

    def values(self, rollout: Rollout) -> ByPart:
        """The critic: every rank's values of its samples, as references by data-parallel part."""
        self._check_parts(rollout)
        refs = [
            rank.values.remote(rollout.rollout_id, rollout.parts[d])
            for rank, d in zip(self.ranks, self.dp_ranks)
        ]
        return self._by_part(
            list(self._wait(refs, f"the critic's values of rollout {rollout.rollout_id}", "values"))
        )

    def _by_part(self, per_rank: list[Any]) -> ByPart:
        """Per-rank answers as {data-parallel part: the answers of its ranks}."""
        out: ByPart = {}
        for d, answer in zip(self.dp_ranks, per_rank, strict=True):
            out.setdefault(d, []).append(answer)
        return out

    def train_values(self, rollout: Rollout, values: ByPart, returns: ByPart) -> TrainOutput:
        """The critic's steps (rank 0's output); each rank fetches its own part's values and returns."""
        refs = [
            rank.train_values.remote(
                rollout.rollout_id, rollout.parts[d], values.get(d, []), returns.get(d, [])
            )
            for rank, d in zip(self.ranks, self.dp_ranks)
        ]
        return self._wait(refs, f"the critic's train step of rollout {rollout.rollout_id}", "train_values")[0]

    def _check_parts(self, rollout: Rollout) -> None:
        if len(rollout.parts) != max(self.dp_ranks) + 1:
            raise RuntimeError(
                f"rollout {rollout.rollout_id} came in {len(rollout.parts)} parts for "
                f"{max(self.dp_ranks) + 1} data-parallel replicas"
            )

    def push_weights(self, version: int) -> dict[str, Any]:
        b = self.config.bridge
        refs = [rank.push_weights.remote(str(version), b.buffer_size, b.verify) for rank in self.ranks]
        return self._wait(refs, f"the weight push of version {version}", "push")[0] or {}

    def dump_adapter(self, folders: list[str]) -> int:
        """--debug-sync-parameters-path with --lora-push adapter: the trainer's adapter into each
        engine's `before` folder (TrainActor.dump_adapter); the number of tensors."""
        refs = [rank.dump_adapter.remote(folders) for rank in self.ranks]
        return int(self._wait(refs, "the trainer's adapter dump", "dump_adapter")[0])

    def connect(self, engines: EngineGroup, only: list[int] | None = None) -> None:
        """Push to the engines up or joining (`only`: to those engines alone)."""
        group: Any = engines  # RayEngineGroup: the topology of the engines it names
        topology = group.topology if only is None else group.topology_of(only)
        key = engines.client_config.api_key  # type: ignore[attr-defined]
        push_fault = self.config.debug.push_fault
        refs = [rank.connect_engines.remote(topology, push_fault, key) for rank in self.ranks]
        self._wait(refs, "connecting the weight push", "connect", hang=False)
        self.transport = topology.label
        self.connected = (tuple(topology.urls), engines.changes)  # type: ignore[attr-defined]

    def connected_to(self, engines: EngineGroup) -> bool:
        """The bridge reaches the engines a push must reach now: same addresses, and no engine
        restarted or marked down since (a restarted engine may come back on the same port)."""
        urls = tuple(engines.url(j) for j in engines.targets())  # type: ignore[attr-defined]
        return self.connected == (urls, engines.changes)  # type: ignore[attr-defined]

    def ensure_connected(self, engines: EngineGroup) -> None:
        """connect() when the engines a push must reach changed (a restart, an engine down)."""
        if not self.connected_to(engines):
            self.connect(engines)

    def save(self, rollout_id: int, data_state: dict[str, int] | None, path: str | None = None) -> None:
        """A checkpoint under --save (`path`: elsewhere, the critic's)."""
        path = path or self.config.checkpoint.save
        refs = [rank.save.remote(rollout_id, path, {"data": data_state}) for rank in self.ranks]
        self._wait(refs, f"the checkpoint save of rollout {rollout_id}", "save", hang=False)

    def save_hf(self, critic: bool = False) -> None:
        """--save-hf (`critic`: the critic's, in <--save-hf>/critic)."""
        path = self.config.checkpoint.save_hf
        assert path is not None  # the Save hook calls this with --save-hf only
        if critic:
            path = os.path.join(path, "critic")
        refs = [rank.save_hf.remote(path) for rank in self.ranks]
        self._wait(refs, "the Hugging Face export (--save-hf)", "save_hf", hang=False)

    def wake(self) -> None:
        if self.offload:
            self._wait(
                [rank.wake.remote() for rank in self.ranks], "waking up (--offload)", "wake", hang=False
            )

    def sleep(self, keep_params: bool = False) -> None:
        if self.offload:
            refs = [rank.sleep.remote(keep_params=keep_params) for rank in self.ranks]
            self._wait(refs, "offloading (--offload)", "sleep", hang=False)

    def _wait(self, refs: list[Any], what: str, phase: str, hang: bool = True) -> Any:
        """The ranks' results; with --hang-timeout (`hang`: the train step and the push, which the
        ranks' watchdog covers), HangError once `what` runs longer; a rank that died ends the wait
        at once with TrainRankDied."""
        timeout = self.config.debug.hang_timeout if hang else None
        try:
            return self.progress.wait(refs, phase, timeout) if self.progress else wait_refs(refs, timeout)
        except Exception as e:
            if isinstance(e, TimeoutError) and not isinstance(e, ray.exceptions.RayError):
                self._hung(what)  # --hang-timeout (a rank's own TimeoutError is a RayError too)
            # A rank that died leaves its peers failing in (or stuck on) a collective with it: its
            # death, not their errors, is the news. Ranks dead or still stuck are killed at close().
            dead, stuck = _dead_ranks(refs)
            self.hung = self.hung or bool(dead or stuck)
            if not dead:
                raise
            raise TrainRankDied(
                f"train rank {', '.join(map(str, dead))} of {len(self.ranks)} died during {what}: "
                f"{_first_line(e)}\n{self._resume_hint()}"
            ) from None

    def _hung(self, what: str) -> NoReturn:
        from slime.debug.hang import HangError, wait_for_dumps

        timeout = self.config.debug.hang_timeout
        assert timeout is not None
        self.hung = True
        hang_dir = os.path.join(self.log_dir, "hang")
        found = wait_for_dumps(hang_dir, len(self.ranks), prefix="critic" if self.critic else "")
        raise HangError(
            f"{what} has run longer than --hang-timeout {timeout:g} s: the Python stacks of {len(found)} "
            f"of {len(self.ranks)} {'critic' if self.critic else 'train'} ranks are in {hang_dir}/ "
            f"({', '.join(found) or 'none written'})"
        ) from None

    def _resume_hint(self) -> str:
        """Where the job can resume from (--load), read from the checkpoint tracker."""
        root = self.config.checkpoint.save
        if not root:
            return "No checkpoint is saved (--save not given): a new run starts from the beginning."
        tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
        try:
            with open(tracker) as f:
                last = f.read().strip()
        except OSError:
            return f"No checkpoint was completed in {root} yet: a new run starts from the beginning."
        return (
            f"The last complete checkpoint in {root} is of rollout {last}; continue with "
            f"--load {root} (a save cut short is left as *.partial and never loaded)."
        )
