"""The mixture-of-experts training flags' config (`TrainConfig.moe`). No torch import here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEOptions:
    """Mixture-of-experts training flags (FSDP: slime.backends.fsdp.moe)."""

    moe_aux_loss_coeff: float = 0.0
    """`--moe-aux-loss-coeff`: megatron-core's load-balancing loss (aux_loss) times this."""
    moe_router_load_balancing_type: str | None = None
    """`--moe-router-load-balancing-type`: aux_loss (the default: over each micro-batch's tokens),
    seq_aux_loss (over each sequence's, averaged over the step's sequences) or none."""
    moe_router_dtype: str | None = None
    """`--moe-router-dtype`: fp32 or fp64 routing (None: as the model computes it)."""
    use_routing_replay: bool = False
    """`--use-routing-replay` (R2): training steps use the log-prob pass's experts."""
    use_rollout_routing_replay: bool = False
    """`--use-rollout-routing-replay` (R3): log-prob and training passes use the engine's experts."""
    moe_router_bias_update_rate: float = 0.0
    """`--moe-router-bias-update-rate`: after each optimizer step the routers' expert bias moves by
    this rate times sign(mean count - the expert's count) of the step's real training tokens
    (slime.backends.expert_bias); 0: the bias stays as loaded."""

    def __post_init__(self) -> None:
        if not self.moe_aux_loss_coeff >= 0:
            raise ValueError(f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        if not self.moe_router_bias_update_rate >= 0:
            raise ValueError(
                f"--moe-router-bias-update-rate must be >= 0, got {self.moe_router_bias_update_rate}"
            )
        if self.use_routing_replay and self.use_rollout_routing_replay:
            raise ValueError(
                "--use-routing-replay (R2) and --use-rollout-routing-replay (R3) replay different "
                "routings: give one"
            )

    def no_expert_bias(self, model: str) -> str:
        """The refusal of a bias update rate for `model` (the checkpoint, named), whose routers have
        no expert bias."""
        return (
            f"--moe-router-bias-update-rate {self.moe_router_bias_update_rate} needs routers with an expert "
            f"bias (DeepSeek-V3, GLM-4.5+, GLM-4.7-Flash); {model} has none"
        )

    @property
    def aux_loss_coeff(self) -> float:
        return 0.0 if self.moe_router_load_balancing_type == "none" else self.moe_aux_loss_coeff

    @property
    def per_sequence(self) -> bool:
        """The load-balancing loss is megatron-core's seq_aux_loss (each sequence's own)."""
        return self.moe_router_load_balancing_type == "seq_aux_loss"

    @property
    def needs_moe(self) -> str | None:
        """The first flag given that only a mixture-of-experts model can honour (None: none)."""
        return self.needs_router_hooks(router_fp32=False)

    def needs_router_hooks(self, router_fp32: bool) -> str | None:
        """The first flag given that the train backends honour by hooking the routers (None:
        none); `router_fp32`: the model routes in float32 by itself, so --moe-router-dtype fp32
        needs nothing."""
        for name, on in (
            ("--moe-aux-loss-coeff", self.aux_loss_coeff > 0),
            ("--moe-router-dtype", self.moe_router_dtype not in (None, *(("fp32",) if router_fp32 else ()))),
            ("--use-routing-replay", self.use_routing_replay),
            ("--use-rollout-routing-replay", self.use_rollout_routing_replay),
        ):
            if on:
                return name
        return None
