"""Where the loop's per-step metrics go: metrics.jsonl always, TensorBoard and wandb on request.

`metrics.jsonl` (one JSON object per record, flushed at once) is the source of truth that
scripts and the demo's plot read. `--use-tensorboard` writes event files to `--tb-dir`
(default `<log dir>/tensorboard`); `--use-wandb` logs to wandb, offline unless an API key is
configured or `--wandb-mode online` is given. Both packages are imported only when asked for.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


def check_available(use_wandb: bool, use_tensorboard: bool) -> str | None:
    """A one-line problem when a requested logging package is not installed, else None."""
    import importlib.util

    if use_wandb and importlib.util.find_spec("wandb") is None:
        return "--use-wandb needs the wandb package: pip install wandb (or drop --use-wandb)"
    if use_tensorboard and importlib.util.find_spec("tensorboard") is None:
        return "--use-tensorboard needs the tensorboard package: pip install tensorboard"
    return None


def tensorboard_dir(cfg: Any, log_dir: str) -> str:
    """--tb-dir; else TENSORBOARD_DIR; else with --tb-project-name slime's
    tensorboard_log/PROJECT/EXPERIMENT (EXPERIMENT: --tb-experiment-name or the start time); else
    <log dir>/tensorboard."""
    if cfg.tb_dir:
        return str(cfg.tb_dir)
    if os.environ.get("TENSORBOARD_DIR"):
        return os.environ["TENSORBOARD_DIR"]
    if cfg.tb_project_name:
        import time

        experiment = cfg.tb_experiment_name or time.strftime("%Y%m%d_%H%M%S")
        return os.path.join("tensorboard_log", cfg.tb_project_name, experiment)
    return os.path.join(log_dir, "tensorboard")


class Tracker:
    """Logs one record per step to every configured sink."""

    def __init__(self, log_dir: str, logging_config: Any = None, run_config: dict[str, Any] | None = None):
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, "metrics.jsonl")
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self._tb: Any = None
        self._wandb: Any = None
        cfg = logging_config
        if cfg is not None and cfg.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb_dir = tensorboard_dir(cfg, log_dir)
            self._tb = SummaryWriter(self.tb_dir)
        if cfg is not None and cfg.use_wandb:
            import wandb

            if cfg.wandb_key and cfg.wandb_mode == "online":  # slime's --wandb-key / --wandb-host
                wandb.login(key=cfg.wandb_key, host=cfg.wandb_host)
            run_dir = cfg.wandb_dir or log_dir
            os.makedirs(run_dir, exist_ok=True)
            group = cfg.wandb_group
            if group and cfg.wandb_random_suffix and not cfg.wandb_run_id:  # slime's: runs of a group apart
                import secrets
                import string

                group += "_" + "".join(
                    secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8)
                )
            self._wandb = wandb.init(
                project=cfg.wandb_project,
                entity=cfg.wandb_team,
                group=group,
                name=group,
                id=cfg.wandb_run_id,
                resume="allow" if cfg.wandb_run_id else None,
                mode=cfg.wandb_mode,
                dir=run_dir,
                config=run_config or {},
            )
            logger.info("wandb run %s (mode %s) in %s", self._wandb.id, cfg.wandb_mode, log_dir)

    steps_per_rollout: int | None = None
    """--wandb-always-use-train-step: `step` is scaled to optimizer steps (set by the metrics hook)."""

    def log(self, record: dict[str, Any], step: int) -> None:
        """Write `record` (flat name → number) as of `step` (rollouts trained so far; optimizer
        steps taken with `steps_per_rollout`)."""
        if self.steps_per_rollout is not None:
            step *= self.steps_per_rollout
        self._file.write(json.dumps({"step": step, **record}) + "\n")
        self._file.flush()
        numbers = {k: v for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if self._tb is not None:
            for name, value in numbers.items():
                self._tb.add_scalar(name, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
