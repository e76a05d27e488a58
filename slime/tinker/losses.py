"""The loss functions of Tinker's forward_backward, as Tinker defines them: each a sum over the
datum's tokens (no mean: an aggregation belongs in the weights or advantages the caller sends).

    cross_entropy        -sum(logp * weights)                     (target_tokens, weights)
    importance_sampling  -sum(r * A), r = exp(logp - q)           (target_tokens, logprobs q, advantages)
    ppo                  -sum(min(r A, clip(r, low, high) A))     (the same)
    cispo                -sum(sg(clip(r, low, high)) * logp * A)  (the same)

`low` and `high` are `clip_low_threshold` and `clip_high_threshold` of the loss config (ratios,
0.8 and 1.2 unless given), or the datum's own per-token inputs of those names. A loss this server
does not build (dro, stable_reinforce, a server-side custom loss) is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from slime.tinker.errors import TinkerUserError

CLIP_LOW, CLIP_HIGH = 0.8, 1.2
"""Tinker's default ratio bounds for ppo and cispo (epsilon 0.2 on either side)."""

Inputs = Mapping[str, torch.Tensor]


def _cross_entropy(logp: torch.Tensor, inputs: Inputs, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    return -(logp * inputs["weights"]).sum()


def _ratio(logp: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    return torch.exp(logp - inputs["logprobs"])


def _importance_sampling(
    logp: torch.Tensor, inputs: Inputs, low: torch.Tensor, high: torch.Tensor
) -> torch.Tensor:
    return -(_ratio(logp, inputs) * inputs["advantages"]).sum()


def _ppo(logp: torch.Tensor, inputs: Inputs, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    ratio, advantages = _ratio(logp, inputs), inputs["advantages"]
    clipped = torch.minimum(torch.maximum(ratio, low), high)
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


def _cispo(logp: torch.Tensor, inputs: Inputs, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    clipped = torch.minimum(torch.maximum(_ratio(logp, inputs), low), high).detach()
    return -(clipped * logp * inputs["advantages"]).sum()


Loss = Callable[[torch.Tensor, Inputs, torch.Tensor, torch.Tensor], torch.Tensor]
LOSSES: dict[str, tuple[Loss, tuple[str, ...]]] = {
    "cross_entropy": (_cross_entropy, ("target_tokens", "weights")),
    "importance_sampling": (_importance_sampling, ("target_tokens", "logprobs", "advantages")),
    "ppo": (_ppo, ("target_tokens", "logprobs", "advantages")),
    "cispo": (_cispo, ("target_tokens", "logprobs", "advantages")),
}
"""Each loss and the loss_fn_inputs it needs."""
NOT_BUILT = ("dro", "gspo", "stable_reinforce", "custom")


def check(loss_fn: str, data_inputs: list[Mapping[str, object]], config: Mapping[str, float | str]) -> None:
    """Refuse an unknown loss, a missing input or a bad clip threshold, naming it."""
    if loss_fn not in LOSSES:
        built = ", ".join(LOSSES)
        why = "is not built on this server" if loss_fn in NOT_BUILT else "is not a Tinker loss"
        raise TinkerUserError(f"loss_fn {loss_fn!r} {why}; the built losses: {built}")
    needed = LOSSES[loss_fn][1]
    for i, inputs in enumerate(data_inputs):
        missing = [name for name in needed if name not in inputs]
        if missing:
            raise TinkerUserError(
                f"datum {i}: loss_fn {loss_fn!r} needs loss_fn_inputs {', '.join(needed)}; it lacks "
                f"{', '.join(missing)}"
            )
    for key in ("clip_low_threshold", "clip_high_threshold"):
        if key in config and not isinstance(config[key], float | int):
            raise TinkerUserError(f"loss_fn_config[{key!r}] must be a number, got {config[key]!r}")
    unknown = sorted(set(config) - {"clip_low_threshold", "clip_high_threshold"})
    if unknown:
        raise TinkerUserError(
            f"loss_fn_config {', '.join(map(repr, unknown))}: not a setting of loss_fn {loss_fn!r} "
            "(clip_low_threshold, clip_high_threshold)"
        )


def loss(loss_fn: str, logp: torch.Tensor, inputs: Inputs, config: Mapping[str, float | str]) -> torch.Tensor:
    """The datum's loss (a scalar): `logp` the log-probs of its target tokens under the model."""
    fn = LOSSES[loss_fn][0]
    low = inputs.get("clip_low_threshold", torch.tensor(float(config.get("clip_low_threshold", CLIP_LOW))))
    high = inputs.get(
        "clip_high_threshold", torch.tensor(float(config.get("clip_high_threshold", CLIP_HIGH)))
    )
    return fn(logp, inputs, low.to(logp), high.to(logp))
