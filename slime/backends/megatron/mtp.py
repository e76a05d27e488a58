"""Multi-token prediction (MTP) in the Megatron backend: `--mtp-num-layers N` builds megatron-core's
MTP block (DeepSeek-V3's and GLM-4.5+'s MTP modules, loaded from the checkpoint's extra layers:
slime.backends.megatron.layer_map), and `--enable-mtp-training` trains it, as slime does:

- module k (k = 1..N) predicts token i + k + 1 at position i, from the previous depth's hidden
  state (the decoder's for k = 1) and token i + k's embedding (megatron-core's
  MultiTokenPredictionLayer, with the model's embedding and output head);
- its loss is the cross entropy at temperature 1 on the response tokens the policy loss counts
  (the sample's loss mask, moved onto the predicted token), averaged over the optimizer step's
  tokens (every micro-batch of every data-parallel rank), times `--mtp-loss-scaling-factor / N`.
  slime (megatron-core) averages each micro-batch's tokens and then the micro-batches, which
  weighs a token by the size of the micro-batch it landed in; one mean over the step's tokens
  gives the same loss however the step is split over ranks and micro-batches;
- it trains the MTP modules only: as in slime's megatron-core, the block reads the decoder's
  hidden states, the embedding and the output head detached, so the policy's weights see the
  policy loss alone; the step metrics report `mtp_loss` (all depths) and `mtp_{k}_loss` as
  slime logs them.

Without `--enable-mtp-training` the modules are loaded, saved and exported with the model but
neither run nor trained (their parameters are frozen). Log-prob passes never run them. No engine
here runs MTP modules (speculative decoding), so the weight push leaves them out.

megatron-core 0.16's GPTModel computes the MTP loss only beside the language-model loss (it wants
`labels` and then returns the loss, not logits); the actor needs the logits (its own
temperature-scaled log-probs and entropy), so `mtp_model_class` gives a GPTModel whose
post-processing runs the MTP block, attaches its loss and returns the logits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class MTPObjective:
    """What the model's post-processing needs for the MTP loss of the micro-batch it runs, and
    what it reports back (set by the actor before each training pass)."""

    vocab_size: int
    tp_rank: int
    tp: int
    tp_group: Any
    cp_group: Any = None
    """Context parallelism: each CP rank's loss covers its own tokens (the metric sums them)."""
    scales: list[float] = field(default_factory=list)
    """Per depth: the weight of one target token's cross entropy (none: the MTP block is not run)."""
    metric_scales: list[float] = field(default_factory=list)
    """Per depth: 1 / the step's target tokens (the metric is their mean)."""
    losses: list[torch.Tensor] = field(default_factory=list)

    def begin(self, counts: torch.Tensor, factor: float) -> None:
        """A training step: `counts[d]`, the step's target tokens at depth d over every rank."""
        depths = counts.numel()
        self.metric_scales = [1.0 / max(float(c), 1.0) for c in counts]
        self.scales = [factor / depths * m for m in self.metric_scales]
        self.losses = []

    @property
    def active(self) -> bool:
        return bool(self.scales)

    def end(self) -> dict[str, torch.Tensor]:
        """The step's metric sums (summed over the replicas: the step's means, as slime names
        them), and no MTP run until the next `begin`."""
        self.scales = []
        if self.cp_group is not None and self.losses:
            import torch.distributed as dist

            stacked = torch.stack(self.losses)
            dist.all_reduce(stacked, group=self.cp_group)
            self.losses = list(stacked)
        out = {f"mtp_{d + 1}_loss": loss.cpu() for d, loss in enumerate(self.losses)}
        if self.losses:
            out["mtp_loss"] = sum(out.values(), torch.zeros((), dtype=torch.float64))
        return out

    def record(self, depth: int, loss: torch.Tensor) -> None:
        value = loss.detach().double() * self.metric_scales[depth]  # on the device: read once, in `end`
        if depth < len(self.losses):
            self.losses[depth] = self.losses[depth] + value
        else:
            self.losses.append(value)


class _AttachLoss(torch.autograd.Function):
    """`output` unchanged forward; backward also starts `loss`'s gradient (weight 1). megatron-core's
    MTPLossAutoScaler does this with a class-wide scale its schedule sets per loss mode; the
    weight here is in the loss already (MTPObjective.scale)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def token_loss_mask(mb: Any) -> torch.Tensor:
    """[rows, length] float over the micro-batch's input ids: each response token's loss-mask value
    at the token's own place (0 on prompts and padding), slime's `full_loss_masks`."""
    from slime.backends.micro_batch import MicroBatch

    assert isinstance(mb, MicroBatch)
    rows, cols, _ = mb.predictions()
    values = torch.cat([mb.loss_mask[row, :r] for row, r in enumerate(mb.response_lengths)])
    out = torch.zeros(mb.input_ids.shape, dtype=torch.float32, device=mb.input_ids.device)
    return out.index_put((rows, cols + 1), values.to(out.device))


def target_counts(mbs: list[Any], depths: int) -> torch.Tensor:
    """[depths]: the micro-batches' target tokens at each depth (depth d's target of position i is
    token i + d + 2 of the same sample, weighted by its loss mask)."""
    counts = torch.zeros(depths, dtype=torch.float64)
    for mb in mbs:
        flat = token_loss_mask(mb).flatten().double().cpu()
        for start, p, r in zip(mb.token_starts(), mb.prompt_lengths, mb.response_lengths, strict=True):
            sample = flat[start : start + p + r]
            for d in range(depths):
                counts[d] += sample[d + 2 :].sum()
    return counts


def _mtp_losses(
    model: Any,
    hidden: torch.Tensor,
    depths: list[torch.Tensor],
    labels: torch.Tensor,
    mask: torch.Tensor,
    packed: Any,
    output_weight: Any,
) -> torch.Tensor:
    """The decoder's hidden states with each depth's weighted loss attached (its backward)."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    from slime.backends.megatron.logprobs import vocab_parallel_log_probs

    objective: MTPObjective = model.mtp_objective
    cp = objective.cp_group
    # token-aligned -> aligned with the next-token labels, then one more place per depth
    labels, _ = roll_tensor(labels, shifts=-1, dims=-1, cp_group=cp, packed_seq_params=packed)
    mask, _ = roll_tensor(mask, shifts=-1, dims=-1, cp_group=cp, packed_seq_params=packed)
    for depth, states in enumerate(depths):
        labels, _ = roll_tensor(labels, shifts=-1, dims=-1, cp_group=cp, packed_seq_params=packed)
        mask, _ = roll_tensor(mask, shifts=-1, dims=-1, cp_group=cp, packed_seq_params=packed)
        # the shared head, detached as in slime: the MTP loss trains the MTP modules only
        head = output_weight if output_weight is not None else model.output_layer.weight
        logits, _ = model.output_layer(states, weight=head.detach())  # [s, b, padded vocab / TP]
        rows, cols = (mask > 0).nonzero(as_tuple=True)  # the weighted targets only, in float32
        log_probs, _ = vocab_parallel_log_probs(
            logits[cols, rows].float(),
            labels[rows, cols],
            objective.vocab_size,
            objective.tp_rank,
            objective.tp,
            objective.tp_group,
        )
        loss = -(log_probs * mask[rows, cols]).sum()
        objective.record(depth, loss)
        hidden = _AttachLoss.apply(hidden, objective.scales[depth] * loss)
    return hidden


@functools.cache
def mtp_model_class() -> type:
    """megatron-core's GPTModel whose post-processing (with an MTP block) runs the block and
    attaches its loss when `labels` (the input ids) are given and `mtp_objective.scale` is set,
    and always returns the logits ([batch, sequence, padded vocabulary / TP])."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    class MTPGPTModel(GPTModel):  # type: ignore[misc, valid-type]
        mtp_objective: MTPObjective | None = None

        def _postprocess(
            self,
            hidden_states: torch.Tensor,
            input_ids: torch.Tensor,
            position_ids: torch.Tensor,
            labels: torch.Tensor | None,
            rotary_pos_emb: Any,
            rotary_pos_cos: Any,
            rotary_pos_sin: Any,
            mtp_in_postprocess: Any = None,
            loss_mask: torch.Tensor | None = None,
            attention_mask: Any = None,
            packed_seq_params: Any = None,
            sequence_len_offset: Any = None,
            extra_block_kwargs: Any = None,
            **_: Any,
        ) -> torch.Tensor:
            output_weight = (
                self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
            )
            objective = self.mtp_objective
            if mtp_in_postprocess and labels is not None and objective is not None and objective.active:
                # As slime's megatron-core: the block reads the decoder's hidden states and the
                # embedding detached, so its loss reaches the MTP modules and nothing else.
                stacked = self.mtp(
                    input_ids=input_ids,
                    position_ids=position_ids,
                    hidden_states=hidden_states.detach(),
                    attention_mask=attention_mask,
                    rotary_pos_emb=rotary_pos_emb,
                    rotary_pos_cos=rotary_pos_cos,
                    rotary_pos_sin=rotary_pos_sin,
                    packed_seq_params=packed_seq_params,
                    sequence_len_offset=sequence_len_offset,
                    embedding=lambda **kw: self.embedding(**kw).detach(),
                    **(extra_block_kwargs or {}),
                )
                _main, *depths = torch.chunk(stacked, 1 + len(self.mtp.layers), dim=0)
                assert loss_mask is not None
                hidden_states = _mtp_losses(
                    self, hidden_states, depths, labels, loss_mask, packed_seq_params, output_weight
                )
            if not self.post_process:
                return hidden_states
            logits, _ = self.output_layer(hidden_states, weight=output_weight)
            return logits.transpose(0, 1).contiguous()

    return MTPGPTModel


def mtp_block_spec(config: Any, spec: Any, fold_norms: bool) -> Any:
    """megatron-core's MTP block spec from the decoder's (its last layer's spec)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=fold_norms)


def attach(model: Any, layout: Any, mesh: Any, train: bool, cp_group: Any = None) -> None:
    """The model's MTP objective when `train` (--enable-mtp-training); else its MTP modules kept
    as loaded: no gradient, so no optimizer step moves them. `cp_group`: the context-parallel
    group (None: CP 1)."""
    mtp = getattr(model, "mtp", None)
    if mtp is None:  # not the last pipeline stage
        return
    if train:
        model.mtp_objective = MTPObjective(layout.vocab_size, mesh.tp_rank, mesh.tp, mesh.tp_group, cp_group)
        _without_full_recompute(mtp)
    else:
        for p in mtp.parameters():
            p.requires_grad_(False)


def _without_full_recompute(block: Any) -> None:
    """The MTP layers run without megatron-core's full recompute (the decoder keeps it):
    megatron-core 0.16 recomputes them with its reentrant checkpoint, which gives the parameters
    inside a gradient only when one of its inputs needs one, and the block's inputs are detached:
    the modules would silently not train. One layer per depth is kept in memory instead."""
    import copy

    for layer in block.layers:
        if layer.config.recompute_granularity == "full":
            layer.config = copy.copy(layer.config)
            layer.config.recompute_granularity = None


def begin_step(
    model: Any, mbs: list[Any], factor: float, dp_group: Any, device: torch.device
) -> MTPObjective | None:
    """A training step's MTP objective (None: no MTP modules trained here), its target counts
    summed over the data-parallel replicas (`dp_group`; None: one)."""
    found = objective(model)
    if found is not None:
        counts = target_counts(mbs, len(model.mtp.layers)).to(device)
        if dp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(counts, group=dp_group)
        found.begin(counts.cpu(), factor)
    return found


def without_modules(layout: Any) -> Any:
    """The layout without MTP modules (a reference or teacher checkpoint need not hold them)."""
    import dataclasses

    return dataclasses.replace(layout, mtp_layers=0)


def module_state(model: Any) -> dict[str, torch.Tensor]:
    """Copies of the model's MTP tensors (none without MTP modules), with a later pipeline stage's
    copy of the embedding that only they read."""
    copy = "embedding.word_embeddings.weight" if not model.pre_process else None
    return {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if (k.startswith("mtp.") or k == copy) and not k.endswith("._extra_state")
    }


def saved_config(config: Any, layout: Any) -> Any:
    """The HF config a saved checkpoint gets: num_nextn_predict_layers says the MTP modules it holds
    (None: --hf-checkpoint's config as it is, for a model without the field)."""
    if not hasattr(config, "num_nextn_predict_layers"):
        return None
    import copy

    out = copy.deepcopy(config)
    out.num_nextn_predict_layers = layout.mtp_layers
    return out


def objective(model: Any) -> MTPObjective | None:
    """The model's MTP objective (None: no MTP modules trained on this rank)."""
    return getattr(model, "mtp_objective", None)
