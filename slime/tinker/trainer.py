"""A Tinker training client's model: the FSDP actor's model and optimizer (slime.backends.fsdp)
with PEFT's LoRA adapters, driven by Tinker's requests instead of slime's RL loop.

- `forward` / `forward_backward`: per datum, the log-probs of its target tokens (position i
  predicts target_tokens[i] from the input up to i), the loss Tinker defines
  (slime.tinker.losses) summed over tokens, its gradient added to the adapters' (gradients
  accumulate over calls until the next optim_step, as Tinker's do).
- `optim_step`: AdamW with the call's own learning rate, betas, eps and weight decay, the
  gradient norm clipped when `grad_clip_norm` > 0; then the gradients are cleared.

Which layers get adapters (Tinker's LoraConfig): `train_attn` the attention's linear layers
(self-attention, linear attention), `train_mlp` the MLP's (a mixture-of-experts model's fused
experts too, per expert, slime.utils.peft_experts), `train_unembed` the LM head. The adapters'
alpha is this server's `--lora-alpha` (scaling alpha / rank).

All of a server's models run on one thread (slime.tinker.service) and, with `--train-ranks N`,
on N FSDP ranks (slime.tinker.ranks): a TrainingModel is one rank's part, a RankedModel the
model on all of them, which the service calls. Each rank takes every N-th datum of a request;
the calls are never concurrent.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from slime.tinker import losses
from slime.tinker.errors import TinkerUserError
from slime.tinker.ranks import RankGroup
from slime.tinker.wire import Datum


@dataclass(frozen=True)
class LoraSpec:
    """Tinker's LoraConfig."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    @classmethod
    def parse(cls, data: Any) -> LoraSpec:
        if not isinstance(data, dict) or not isinstance(data.get("rank"), int) or data["rank"] < 1:
            raise TinkerUserError(f"lora_config must hold an int rank >= 1, got {data!r}")
        spec = cls(
            data["rank"],
            data.get("seed"),
            bool(data.get("train_mlp", True)),
            bool(data.get("train_attn", True)),
            bool(data.get("train_unembed", True)),
        )
        if not (spec.train_mlp or spec.train_attn or spec.train_unembed):
            raise TinkerUserError(
                "lora_config: at least one of train_mlp, train_attn, train_unembed must be true"
            )
        return spec


@functools.cache
def base_config(path: str) -> Any:
    """The config of a served base model's checkpoint, read once (the creation of each training
    client and each sample without max_tokens ask for it)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def lora_targets(hf_config: Any, spec: LoraSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(--target-modules, --target-parameters) of a LoraConfig on the model of `hf_config`: each
    linear layer named by its parent and its own name (`self_attn.q_proj`, `mlp.up_proj`, PEFT's
    dotted-tail rule), the fused experts by theirs (`mlp.experts.gate_up_proj`). A
    vision-language model's vision tower gets none (its adapters are its language model's, as
    the FSDP actor's LoRA has them)."""
    from torch import nn

    from slime.backends.fsdp.lora import tower_linear
    from slime.utils.model_families import auto_model_class

    with torch.device("meta"):
        model = auto_model_class(hf_config).from_config(
            copy.deepcopy(hf_config)
        )  # (the cached one untouched)
    wanted = {"unembed": spec.train_unembed, "mlp": spec.train_mlp, "attn": spec.train_attn, None: False}
    modules: set[str] = set()
    parameters: set[str] = set()
    tower = set(tower_linear(model))
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name in tower:
            continue
        parts = name.split(".")
        kind = (
            "unembed"
            if parts[-1] == "lm_head"
            else "mlp"
            if "mlp" in parts
            else "attn"
            if any("attn" in p for p in parts)
            else None
        )
        if wanted[kind]:
            modules.add("lm_head" if kind == "unembed" else ".".join(parts[-2:]))
    if spec.train_mlp:
        parameters = {
            ".".join(n.split(".")[-3:])
            for n, p in model.named_parameters()
            if p.dim() == 3 and ".experts." in n
        }
    if not modules and not parameters:
        raise TinkerUserError(f"lora_config {spec}: no layer of this model gets an adapter")
    return tuple(sorted(modules)), tuple(sorted(parameters))


class PrecisionError(RuntimeError):
    """--check-precision's step-0 gate failed."""


class TrainingModel:
    """One training client's model (module docstring)."""

    def __init__(
        self,
        base_model: str,
        path: str,
        spec: LoraSpec,
        alpha: int,
        device: str,
        init_method: str,
        check_precision: float | None = None,
        rank: int = 0,
        world: int = 1,
    ):
        from slime.backends.fsdp.actor import FSDPBackend
        from slime.config.lora import LoRAConfig
        from slime.config.train import BatchConfig, TrainConfig

        self.base_model, self.path, self.spec, self.alpha = base_model, path, spec, alpha
        modules, parameters = lora_targets(base_config(path), spec)
        # served as adapters, never merged: a tied LM head's adapter acts on the head alone
        lora = LoRAConfig(
            rank=spec.rank, alpha=alpha, target_modules=modules, target_parameters=parameters, push="adapter"
        )
        cfg = TrainConfig(
            hf_checkpoint=path,
            device=device,
            seed=spec.seed if spec.seed is not None else 0,
            lora=lora,
            batch=BatchConfig(global_batch_size=world, micro_batch_size=1),  # (unused: Tinker's own batches)
        )
        self.backend = FSDPBackend(cfg, rank, world, init_method)
        self.rank, self.world = rank, world
        self.backend.init()
        self.vocab_size = int(self.backend.hf_config.get_text_config().vocab_size)
        self.check_precision = check_precision
        self.gap: float | None = None
        self.steps = 0

    @property
    def model(self) -> Any:
        return self.backend.model

    def _target_log_probs(self, datum: Datum) -> torch.Tensor:
        device = self.backend.device
        ids = torch.tensor([datum.tokens], dtype=torch.long, device=device)
        targets = torch.as_tensor(datum.inputs["target_tokens"], dtype=torch.long, device=device)
        logits = self.model(input_ids=ids, use_cache=False).logits[0].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]

    def check(self, data: list[Datum]) -> None:
        """What could fail in a request's data, before any rank starts on it (slime.tinker.ranks)."""
        for i, datum in enumerate(data):
            if max(datum.tokens) >= self.vocab_size or min(datum.tokens) < 0:
                raise TinkerUserError(
                    f"datum {i}: model_input holds token ids outside [0, {self.vocab_size})"
                )
            targets = np.asarray(datum.inputs["target_tokens"])
            if targets.size and (targets.min() < 0 or targets.max() >= self.vocab_size):
                raise TinkerUserError(
                    f"datum {i}: target_tokens hold ids outside the vocabulary [0, {self.vocab_size})"
                )

    def forward_backward(
        self, data: list[Datum], loss_fn: str, config: Mapping[str, float | str], backward: bool
    ) -> tuple[list[tuple[int, dict[str, np.ndarray]]], float]:
        """This rank's datums (every world-th, from its rank on): each one's target log-probs by
        its index (and, with `backward`, the loss's gradient added in), and their loss sum.

        Every rank runs as many passes as the rank with the most datums: one that has run out
        runs the request's first datum with the loss times 0 (FSDP's collectives need the same
        calls on all).
        The ranks' gradients add up (slime's FSDP model sums them, slime.backends.fsdp), as
        Tinker's loss is a sum over all the datums."""
        mine = list(range(self.rank, len(data), self.world))
        passes = -(-len(data) // self.world)
        outputs, total = [], 0.0
        try:
            with torch.set_grad_enabled(backward):
                for k in range(passes):
                    real = k < len(mine)
                    index = mine[k] if real else 0  # (a padding pass: any datum, its loss times 0)
                    datum = data[index]
                    logp = self._target_log_probs(datum)
                    inputs = {key: torch.as_tensor(v, device=logp.device) for key, v in datum.inputs.items()}
                    inputs = {key: v.float() if key != "target_tokens" else v for key, v in inputs.items()}
                    loss = losses.loss(loss_fn, logp, inputs, config)
                    if backward:
                        (loss if real else loss * 0.0).backward()
                        if real:
                            self._keep_gap(logp.detach(), inputs.get("logprobs"))
                    if real:
                        total += float(loss.detach())
                        outputs.append((index, {"logprobs": logp.detach().float().cpu().numpy()}))
        finally:
            if not backward:  # FSDP's root stays gathered after a forward alone (failed or not)
                from slime.backends.fsdp.model_init import reshard

                reshard(self.model)
        return outputs, total

    def _keep_gap(self, logp: torch.Tensor, sampled: torch.Tensor | None) -> None:
        """--check-precision: the largest |trainer - sampler| log-prob of the sampled tokens since
        the last step (the tokens whose sampling log-prob is not 0: a prompt's are sent as 0)."""
        if self.check_precision is None or sampled is None:
            return
        mask = sampled != 0
        if bool(mask.any()):
            gap = float((logp - sampled).abs()[mask].max())
            self.gap = gap if self.gap is None else max(self.gap, gap)

    def optim_step(self, adam: Mapping[str, float]) -> dict[str, float]:
        gap, self.gap = self._gap_over_ranks(), None
        if (
            gap is not None
            and self.steps == 0
            and self.check_precision is not None
            and gap > self.check_precision
        ):
            self.backend.optimizer.zero_grad(set_to_none=True)
            raise PrecisionError(
                f"--check-precision: before the first step the sampler's log-probs of its own samples "
                f"differ from the trainer's by up to {gap:.3g} (> {self.check_precision:g}): the sampler "
                "and the trainer do not compute the same model; the step was not taken and its "
                "gradients were dropped"
            )
        metrics = self._step(adam)
        self.steps += 1
        if gap is not None:
            metrics["sampler_logprob_abs_diff:max"] = gap
        return metrics

    def _gap_over_ranks(self) -> float | None:
        """The largest gap any rank saw (every rank then takes the gate's decision alike)."""
        if self.world == 1 or self.check_precision is None:
            return self.gap
        import torch.distributed as dist

        worst = torch.tensor(-1.0 if self.gap is None else self.gap, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return None if float(worst) < 0 else float(worst)

    def _step(self, adam: Mapping[str, float]) -> dict[str, float]:
        optimizer = self.backend.optimizer
        for group in optimizer.param_groups:
            group["lr"] = adam["learning_rate"]
            group["betas"] = (adam["beta1"], adam["beta2"])
            group["eps"] = adam["eps"]
            group["weight_decay"] = adam["weight_decay"]
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, adam["grad_clip_norm"] or float("inf"))
        full = getattr(norm, "full_tensor", None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": float(full() if full is not None else norm)}

    # ---- checkpoints (slime.tinker.store) ---------------------------------------------------
    def meta(self) -> dict[str, Any]:
        """What a checkpoint records of this model, to build it again."""
        return {"base_model": self.base_model, "lora_config": asdict(self.spec), "lora_alpha": self.alpha}

    def save(self, directory: str, optimizer: bool) -> None:
        """The adapters as a PEFT directory in `directory`/adapter; with `optimizer` also the
        actor's checkpoint (adapters and AdamW moments) in `directory`/state."""
        from slime.utils.peft_files import write_adapter_dir

        named, config = self.backend.export_adapter()  # (every rank takes part)
        adapter = {n: t.detach().cpu().contiguous().clone() for n, t in named}  # (the save may touch them)
        if optimizer:
            self.backend.save(0, os.path.join(directory, "state"))
        if self.rank == 0:  # after the collectives: a failed write leaves no rank waiting in one
            write_adapter_dir(os.path.join(directory, "adapter"), config, adapter)

    def load(self, directory: str, optimizer: bool) -> None:
        """The adapters of a checkpoint (`save`); with `optimizer` its AdamW moments too, else the
        optimizer starts afresh."""
        if optimizer:
            if not os.path.isdir(os.path.join(directory, "state")):
                raise TinkerUserError(
                    "this checkpoint holds no optimizer state (saved for a sampler, or without it)"
                )
            self.backend.load(os.path.join(directory, "state"))
            return
        from slime.backends.fsdp import lora

        tensors = lora.read_adapter(os.path.join(directory, "adapter"), self.model, self.backend.cfg.lora)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name not in tensors:
                    continue
                full = tensors[name].to(device=p.device, dtype=p.dtype)
                if hasattr(p, "to_local"):  # this rank's shard, cut here from the file's whole tensor
                    from torch.distributed.tensor import distribute_tensor

                    p.to_local().copy_(
                        distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                    )
                else:
                    p.copy_(full)
        self.backend.optimizer.state.clear()


class RankedModel:
    """A training client's model on every rank (slime.tinker.ranks): what the service calls.
    Rank 0's TrainingModel checks requests and answers for the model; each call runs on all."""

    def __init__(self, group: RankGroup, key: str, *args: Any):
        """`args`: TrainingModel's, before its rank and world."""
        self.group, self.key = group, key
        self.local: TrainingModel = group.build(key, functools.partial(TrainingModel, *args))
        self.base_model, self.spec, self.alpha = self.local.base_model, self.local.spec, self.local.alpha

    def check(self, data: list[Datum]) -> None:
        self.local.check(data)

    def forward_backward(
        self, data: list[Datum], loss_fn: str, config: Mapping[str, float | str], backward: bool
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per datum its target log-probs, in order; the metrics: `loss:sum` over all the datums."""
        outputs: list[Any] = [None] * len(data)
        total = 0.0
        for share, loss in self.group.call(self.key, "forward_backward", data, loss_fn, config, backward):
            for index, output in share:
                outputs[index] = output
            total += loss
        return outputs, {"loss:sum": total}

    def optim_step(self, adam: Mapping[str, float]) -> dict[str, float]:
        return self.group.call(self.key, "optim_step", adam)[0]

    def save(self, directory: str, optimizer: bool) -> None:
        self.group.call(self.key, "save", directory, optimizer)

    def load(self, directory: str, optimizer: bool) -> None:
        self.group.call(self.key, "load", directory, optimizer)

    def meta(self) -> dict[str, Any]:
        return self.local.meta()

    def close(self) -> None:
        """Its memory goes, on every rank."""
        self.group.drop(self.key)
