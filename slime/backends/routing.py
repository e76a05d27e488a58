"""Mixture-of-experts routing shared by both train backends: which experts a token goes to under
routing replay, megatron-core's load-balancing loss, and the routing tables of R2/R3.

A routing table holds one row per token of a sample, `[tokens, layers, top-k]` expert ids: the
engine's choice for R3 (`rollout_routed_experts`, tokens - 1 rows: the last token is never fed to
the engine), what the log-prob pass chose for R2. -1 keeps the router's own choice (dense layers,
the last token, padding).

The backends hook their routers differently (slime.backends.fsdp.moe on Hugging Face's router,
slime.backends.megatron.moe on megatron-core's TopKRouter); what the hooks compute is here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slime.utils.errors import UsageError
from slime.utils.rollout_batch import RolloutBatch

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
"""--moe-router-dtype: the precision of the router's logits, softmax and top-k."""


def choose(
    probs: torch.Tensor, top_k: int, replay: torch.Tensor | None, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts), each [tokens, k], from the router's probabilities [tokens, E]: its own
    top-k, or the `replay` rows' experts where they are >= 0. The weights are the router's own
    probabilities of those experts (so the router still gets a gradient), renormalised over the k
    when the model does (Qwen3-MoE's norm_topk_prob; megatron-core's moe_router_pre_softmax off)."""
    top, experts = torch.topk(probs, top_k, dim=-1)
    if replay is not None:
        experts = torch.where(replay >= 0, replay, experts)  # (the replay table is on the device)
        top = probs.gather(1, experts)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, experts


def real_token_index(sample_ids: torch.Tensor) -> torch.Tensor:
    """Where the tokens of samples are among a micro-batch's tokens (not padding, whose sample id
    is -1), from sample ids on the host: the load-balancing losses select these rows with it
    (a boolean mask on the device would make the host wait for the device at every layer)."""
    return (sample_ids >= 0).nonzero().squeeze(1)


def sigmoid_weights(
    logits: torch.Tensor, experts: torch.Tensor, normalize: bool, scale: float
) -> torch.Tensor:
    """A sigmoid router's weights (DeepSeek-V3, GLM-4.5+) of `experts` [T, k], chosen by it or
    replayed: their sigmoid scores (the expert bias only chooses, it does not weigh), renormalised
    over the k (+1e-20) when the model does, times its routed scaling factor; the weights
    transformers' and megatron-core's routers give those experts."""
    wide = logits if logits.dtype == torch.float64 else logits.float()  # (--moe-router-dtype fp64)
    top = torch.sigmoid(wide).type_as(logits).gather(1, experts)
    if normalize:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * scale


def group_limited_topk(
    scores: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int, group_top: int
) -> torch.Tensor:
    """The experts [T, k] a sigmoid router with an expert bias and groups routes to, as
    transformers' DeepSeek-V3 router chooses them: the `group_top` groups whose two best biased
    scores sum highest, then the top k biased scores within them (for --moe-router-dtype fp64,
    which recomputes the choice)."""
    choice = scores + bias.to(scores.dtype)
    tokens, num_experts = choice.shape
    per_group = choice.view(tokens, groups, num_experts // groups)
    group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)
    kept = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(group_top, dim=-1).indices, 1.0)
    mask = kept.bool().unsqueeze(-1).expand(tokens, groups, num_experts // groups).reshape(tokens, -1)
    return choice.masked_fill(~mask, float("-inf")).topk(top_k, dim=-1).indices


def load_balancing_loss(
    probs: torch.Tensor, routed: torch.Tensor, top_k: int, group: Any = None
) -> torch.Tensor:
    """megatron-core's `aux_loss` (the switch-transformer load-balancing loss) of one layer over
    the tokens given: E / (k T^2) * sum_e (sum_t p_te) * (tokens routed to e), from the router's
    probabilities [T, E] and the routing [T, E] (1 where a token goes to an expert).

    `group`: the tokens are split over these ranks (megatron-core's sequence parallelism); the sums
    run over all of them, and each rank's gradient reaches its own tokens' probabilities only (the
    value is the same on every rank of the group)."""
    num_experts = probs.shape[-1]
    per_expert = probs.float().sum(dim=0)
    counts = routed.float().sum(dim=0).detach()
    total = float(probs.shape[0])  # (known on the host: no wait for the device)
    square: float | torch.Tensor = total * total
    if _splits_tokens(group):
        tokens = torch.tensor([total], dtype=torch.float64, device=probs.device)
        per_expert = _group_sums(per_expert, counts, tokens, group)
        # the group's tokens stay on the device (no wait); none at all: the sums are 0, so is this
        square = tokens[0].clamp(min=1) ** 2
    elif total == 0:
        return per_expert.sum() * 0.0
    return ((per_expert * counts).sum() * num_experts / (top_k * square)).to(per_expert.dtype)


def _splits_tokens(group: Any) -> bool:
    """Whether `group` is ranks that split the tokens (megatron-core's sequence parallelism)."""
    return group is not None and dist.get_world_size(group) > 1


def _group_sums(
    per_expert: torch.Tensor, counts: torch.Tensor, tokens: torch.Tensor, group: Any
) -> torch.Tensor:
    """The load-balancing sums over the ranks of `group` that split the tokens: `counts` and
    `tokens` summed in place; the probability sums returned as the group's, with the gradient
    reaching this rank's own."""
    if not _splits_tokens(group):
        return per_expert
    others = per_expert.detach().clone()
    dist.all_reduce(others, group=group)
    dist.all_reduce(counts, group=group)
    dist.all_reduce(tokens, group=group)
    return per_expert + (others - per_expert.detach())


def sigmoid_aux_routing(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What megatron-core's load-balancing losses read of a sigmoid router (DeepSeek-V3, GLM-4.5+):
    (scores [T, E], the sigmoid scores normalised over the experts; routed [T, E], 1 at each
    token's top-k of them). Its own routing (expert bias, groups) is not what the loss counts."""
    scores = torch.sigmoid(logits.float())
    scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    routed = torch.zeros_like(scores).scatter_(1, torch.topk(scores, top_k, dim=-1).indices, 1.0)
    return scores, routed


def sequence_balancing_loss(
    probs: torch.Tensor, routed: torch.Tensor, seq: torch.Tensor, num_seqs: int, top_k: int, group: Any = None
) -> torch.Tensor:
    """megatron-core's `seq_aux_loss` of one layer, summed over the sequences (megatron-core then
    divides by their count): each sequence's `load_balancing_loss` over its own tokens,
    E / (k T_s^2) * sum_e (sum_{t in s} p_te) * (tokens of s routed to e). `seq` [T]: each
    token's sequence, 0 .. num_seqs - 1; `group` as for load_balancing_loss."""
    num_experts = probs.shape[-1]
    per_expert = probs.float().new_zeros(num_seqs, num_experts).index_add(0, seq, probs.float())
    counts = routed.float().new_zeros(num_seqs, num_experts).index_add(0, seq, routed.float()).detach()
    # (index_add, not bincount: bincount's output size waits for the device on CUDA)
    tokens = probs.float().new_zeros(num_seqs).index_add(0, seq, torch.ones_like(seq, dtype=torch.float32))
    per_expert = _group_sums(per_expert, counts, tokens, group)
    scale = num_experts / (top_k * tokens.clamp(min=1.0) ** 2)
    return ((per_expert * counts).sum(dim=-1) * scale).sum()


class RouterHooks:
    """What both backends' router hooks share: the model's routing shape and its tables."""

    num_layers: int
    top_k: int
    num_experts: int
    moe_layers: list[int]  # the layers with routed experts (0-based, the whole model's)

    def check_table(self, table: Any, rows: int, what: str) -> torch.Tensor:
        """A per-sample routing table as [rows, layers, k] long, or UsageError naming `what`."""
        t = torch.as_tensor(table)
        if t.dim() != 3 or tuple(t.shape[1:]) != (self.num_layers, self.top_k) or t.shape[0] != rows:
            raise UsageError(
                f"{what}: shape {tuple(t.shape)}, expected ({rows}, {self.num_layers}, {self.top_k}) "
                "(tokens - 1, the model's layers, its num_experts_per_tok)"
            )
        moe = self.moe_layers  # (none on a pipeline stage of dense layers only)
        if t.numel() and moe and (int(t[:, moe].min()) < 0 or int(t[:, moe].max()) >= self.num_experts):
            raise UsageError(f"{what}: expert ids outside [0, {self.num_experts}) in the MoE layers {moe}")
        return t.long()

    def rollout_tables(self, batch: RolloutBatch, positions: list[int]) -> dict[int, torch.Tensor]:
        """R3: the engine's routing of the samples at `positions`, checked, one row per token
        (the last token, which the engine never fed, keeps the router's choice)."""
        if batch.rollout_routed_experts is None:
            raise UsageError(
                "--use-rollout-routing-replay: the rollout has no 'rollout_routed_experts' (the engines must "
                "report them: SGLang or the torch engine with --enable-return-routed-experts, which slime "
                "passes with this flag)"
            )
        tables = {}
        for p in positions:
            rows = len(batch.tokens[p]) - 1
            table = self.check_table(
                batch.rollout_routed_experts[p], rows, f"sample {p}: 'rollout_routed_experts'"
            )
            last = torch.full((1, *table.shape[1:]), -1, dtype=torch.long)
            tables[p] = torch.cat([table, last])
        return tables

    def replay_rows(
        self, tables: dict[int, torch.Tensor], positions: list[int], starts: list[int], num_tokens: int
    ) -> torch.Tensor:
        """One micro-batch's replay table [tokens, layers, k] over its flattened input ids (the
        samples at `starts`; -1 elsewhere)."""
        replay = torch.full((num_tokens, self.num_layers, self.top_k), -1, dtype=torch.long)
        for start, p in zip(starts, positions):
            table = tables[p]
            replay[start : start + len(table)] = table
        return replay
