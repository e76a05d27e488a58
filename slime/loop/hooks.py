"""The hooks around the loop's steps: the start-up checks of docs/debugging.md (parameter-sync
dumps, snapshot/compare, the first push), the --check-precision gates, evaluation and saving.

Each holds the settings it needs and reaches the job only through the loop's typed parts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from slime.loop.core import Hook, Loop
from slime.loop.parts import Evaluator, Step
from slime.utils.job_trace import span

logger = logging.getLogger(__name__)


class SyncParametersDump(Hook):
    """--debug-sync-parameters-path: the engines' parameters before and after one push; the job
    ends there."""

    def __init__(self, root: str, adapter: bool = False):
        """`adapter` (--lora-push adapter): the engines hold no adapter before the push, so the
        trainer writes the adapter it pushes into every engine's `before` folder, under the names
        the engines dump theirs: the tool then compares the engines' adapters with the trainer's
        (and the base weights, never pushed, with themselves)."""
        self.root = root
        self.adapter = adapter

    def before_loop(self, loop: Loop) -> bool:
        assert loop.engines is not None
        before = os.path.join(self.root, "before_sync_parameter")
        after = os.path.join(self.root, "after_sync_parameter")
        counts = loop.engines.dump_parameters(before)
        loop.push()
        loop.engines.dump_parameters(after)
        if self.adapter:
            assert loop.train is not None
            n = loop.train.dump_adapter([os.path.join(before, str(j)) for j in range(len(counts))])
            logger.info(
                "--debug-sync-parameters-path: the trainer wrote the %d adapter tensors it pushed into each "
                "engine's folder of %s/",
                n,
                before,
            )
        logger.info(
            "--debug-sync-parameters-path: %d engine rank(s) dumped %s parameters to %s/ and %s/ (one "
            "torch.save file per HF parameter name); the trainer loaded the same checkpoint, so they must "
            "be equal. Check with:\n  python -m slime.tools.check_sync_parameter --root_dir %s",
            len(counts),
            "/".join(map(str, counts)),
            before,
            after,
            self.root,
        )
        return True


class WeightUpdateEqualCheck(Hook):
    """--check-weight-update-equal: snapshot the engines' --hf-checkpoint weights, scramble them,
    push the trainer's, and require the snapshot back bit for bit (SGLang's /weights_checker)."""

    def __init__(self, adapter: bool = False):
        """`adapter` (--lora-push adapter): the push sends the adapter alone, so the base weights
        are not scrambled but must come out of the push untouched, and the adapter is checked by
        the engines against the trainer's checksums as it arrives (slime.bridge.adapter)."""
        self.adapter = adapter

    def before_loop(self, loop: Loop) -> bool:
        assert loop.engines is not None
        if loop.resumed:
            logger.warning(
                "--check-weight-update-equal: skipped, the resumed trainer's weights are not the checkpoint's"
            )
            return False  # the loop pushed the resumed weights already
        loop.engines.snapshot_weights()
        if not self.adapter:
            loop.engines.scramble_weights()
        loop.push()
        # A bfloat16 trainer pushing into a float32 engine: the engine compares with the checkpoint
        # rounded to bfloat16 and notes it ("N compared with the snapshot rounded to bfloat16, ...").
        notes = sorted(set(loop.engines.compare_weights()))
        logger.info(
            "--check-weight-update-equal: after the first push every engine parameter equals the "
            "checkpoint%s%s",
            " (the base weights, untouched by the adapter push) and every engine received the trainer's "
            "adapter bit for bit (sha256)"
            if self.adapter
            else "",
            "".join(f" ({note})" for note in notes),
        )
        return False


class FirstPush(Hook):
    """Push the trainer's weights before the first rollout: launched engines loaded
    --hf-checkpoint themselves, so with --check-precision this makes the first rollout's
    trainer-vs-engine gate check the bridge too; external engines may hold anything."""

    def __init__(self, why: str):
        self.why = why

    def before_loop(self, loop: Loop) -> bool:
        if not loop.resumed:
            stats = loop.push()
            logger.info(
                "%s: pushed the trainer's weights before the first rollout (%d bytes)",
                self.why,
                int(stats.get("bytes", 0)),
            )
        return False


class PrecisionGates(Hook):
    """--check-precision after each train call: raise PrecisionError (the report) on a failed
    gate; the first rollout's checks also go to <log dir>/precision.json and one log line."""

    def __init__(self, config: Any, log_dir: str, replay_temperature: float | None):
        self.config, self.log_dir, self.replay_temperature = config, log_dir, replay_temperature

    def after_train(self, loop: Loop, step: Step) -> None:
        from slime.debug import precision
        from slime.utils.files import atomic_write_text

        t, d = self.config.train, self.config.debug
        output = step.output
        assert output is not None
        first = step.rollout_id == loop.start
        ctx = precision.Context(
            rollout_id=step.rollout_id,
            first=first,
            mean_tol=d.precision_logprob_tol,
            max_tol=d.precision_logprob_max_tol,
            dtype=d.precision_dtype,
            trainer_temperature=t.rollout_temperature,
            sample_temperature=self.replay_temperature,
            ref_load=t.ref_load if t.ref_load and t.ref_load != t.hf_checkpoint else None,
            separate_log_prob_batches=t.batch.use_dynamic_batch_size
            and t.batch.log_probs_max_tokens_per_gpu not in (None, t.batch.max_tokens_per_gpu),
            replay=self.replay_temperature is not None,
            resumed=loop.resumed,
            lora_adapter=t.lora.adapter_path,
        )
        checks = precision.gates(
            ctx, output.rollout, output.precision, output.steps[0] if output.steps else {}
        )
        if first:
            record = {"rollout_id": step.rollout_id, "checks": [dataclasses.asdict(c) for c in checks]}
            atomic_write_text(os.path.join(self.log_dir, "precision.json"), json.dumps(record, indent=1))
        if precision.failed(checks):
            raise precision.PrecisionError(precision.report(ctx, checks))
        if first:
            logger.info("%s", precision.summary(ctx, checks))


class Evaluate(Hook):
    """--eval-interval: evaluate before training (unless --skip-eval-before-train or resumed) and
    after every `interval` rollouts; the metrics join the step's record."""

    def __init__(
        self,
        evaluator: Evaluator,
        interval: int,
        before_train: bool,
        log: Callable[[dict[str, Any], int], None],
    ):
        self.evaluator, self.interval, self.before_train, self.log = evaluator, interval, before_train, log

    def _evaluate(self, rollout_id: int) -> dict[str, float]:
        result = self.evaluator.evaluate(rollout_id)
        if result.dump_path is not None:
            logger.info("eval after rollout %d saved to %s", rollout_id, result.dump_path)
        return result.metrics

    def before_loop(self, loop: Loop) -> bool:
        if loop.start == 0 and self.before_train:
            step = Step(-1)
            with step.timed("eval"):
                metrics = self._evaluate(-1)
            self.log({"rollout_id": -1, **metrics, "time/eval": step.phases["eval"]}, 0)
            logger.info("eval before training: %s", short_summary(metrics))
        return False

    def after_step(self, loop: Loop, step: Step) -> None:
        if (step.rollout_id + 1) % self.interval == 0:
            with step.timed("eval"):
                step.record.update(self._evaluate(step.rollout_id))


class Save(Hook):
    """--save with --save-interval: a checkpoint (weights, optimizer, data position) every
    `interval` rollouts and after the last; --save-hf: a Hugging Face export at the end."""

    def __init__(self, interval: int | None, save: bool, save_hf: bool):
        self.interval, self.save, self.save_hf = interval, save, save_hf
        self.saved: int | None = None
        self.data_state: dict[str, int] | None = None

    def after_step(self, loop: Loop, step: Step) -> None:
        assert loop.train is not None and step.rollout is not None
        self.data_state = step.rollout.data_state
        if self.save and self.interval and (step.rollout_id + 1) % self.interval == 0:
            with step.timed("save"):
                loop.train.save(step.rollout_id, self.data_state)
            self.saved = step.rollout_id

    def after_loop(self, loop: Loop) -> None:
        assert loop.train is not None
        if self.save and loop.start < loop.total and self.saved != loop.total - 1:
            with span("save", "loop"):
                loop.train.save(loop.total - 1, self.data_state)
        if self.save_hf:
            with span("save_hf", "loop"):
                loop.train.save_hf()


def short_summary(record: dict[str, Any]) -> str:
    """The few numbers of a record worth a log line."""
    keys = (
        "rollout/reward_mean",
        "rollout/accuracy",
        "eval/accuracy",
        "train/loss",
        "train/grad_norm",
        "time/step",
        "time/generate",
        "time/train",
        "time/push",
        "perf/actor_train_tok_per_s",
        "perf/actor_train_mfu",
    )

    def label(key: str) -> str:
        if key.startswith("eval/") or key == "rollout/accuracy":
            return key.replace("/", "_")
        return {"perf/actor_train_tok_per_s": "train_tok/s", "perf/actor_train_mfu": "mfu"}.get(
            key, key.split("/")[-1]
        )

    return " ".join(f"{label(k)}={record[k]:.4g}" for k in keys if k in record)
