"""When two models' logits agree, for the megatron-core vs Hugging Face comparison on a GPU
(tests/test_megatron_gpu.py), and the weights that comparison runs on. Pure functions: their
CPU tests are in tests/test_logit_tolerance.py.

The first GPU run compared logits of weights drawn N(0, 1) everywhere (logits up to |36|)
against absolute bounds: bfloat16 failed everywhere, and so did Hugging Face's own bfloat16
forward against its float32 one (11.8 / 1.75 / 8.18 for qwen2 / qwen3 / llama).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP32_RELATIVE = 1e-4
"""float32 (TF32 off): max |got - want| / max |want|. Measured: ~7e-6 (N(0, 1) weights); a TF32
matmul gives ~2e-3, an error in the model ~1."""

REFERENCE_FACTOR = 3.0
"""Half precision: the model's error against the float32 reference may be this many times the
reference implementation's own half-precision error. Two implementations of the same bfloat16
model round in different places (fused ops, accumulation order, what stays in float32), so
their errors differ by a small factor: megatron-core's was 0.62 / 0.70 / 1.59 times Hugging
Face's on the first GPU run. An error in the model is of the order of the logits themselves."""


@dataclass(frozen=True)
class Agreement:
    ok: bool
    error: float
    """max |got - want|"""
    allowed: float
    summary: str

    def __bool__(self) -> bool:
        return self.ok


def logits_agree(
    got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, reference_error: float | None = None
) -> Agreement:
    """Whether `got` (a model run in `dtype`) agrees with `want` (the reference model in float32,
    TF32 off). float32: relative to the largest |logit|. Half precision: `reference_error`, the
    reference model's own max |half - float32| on the same input, scales the bound; plus one
    rounding of the largest logit in `dtype`, so that a reference that happens to be exact does
    not demand exactness."""
    got, want = got.double(), want.double()
    error = (got - want).abs().max().item()
    scale = want.abs().max().item()
    if dtype == torch.float32:
        allowed = FP32_RELATIVE * scale
        summary = f"float32: max |diff| {error:.3g}, relative {error / scale:.3g} (allowed {FP32_RELATIVE:g})"
    else:
        if reference_error is None:
            raise ValueError(f"{dtype} logits are judged against the reference model's own {dtype} error")
        rounding = torch.finfo(dtype).eps / 2 * scale  # half an ulp of the largest logit
        allowed = REFERENCE_FACTOR * reference_error + rounding
        summary = (
            f"{dtype}: error vs float32 reference {error:.3g}, the reference's own {reference_error:.3g} "
            f"(ratio {error / max(reference_error, 1e-30):.3g}; allowed {allowed:.3g} = "
            f"{REFERENCE_FACTOR:g} x {reference_error:.3g} + {rounding:.3g})"
        )
    return Agreement(error <= allowed, error, allowed, f"{summary}; max |logit| {scale:.3g}")


def realistic_scale(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (N(0, 1) everywhere: tests.test_megatron_convert.tiny's) rescaled so activations,
    attention scores and logits have a trained model's scale: matrices x 1/sqrt(fan-in) (what
    Hugging Face's 0.02 is at a width of ~2500), biases x 0.02, norm weights 1 + 0.1 x (near
    1, still distinct: a misplaced norm stays visible). Not 0.02 itself: at the tiny width of 64
    it leaves attention uniform, and a model with its key heads swapped then passed the bfloat16
    bound (tests/test_logit_tolerance.py)."""
    out = {}
    for name, t in state.items():
        if name.endswith("norm.weight"):
            out[name] = 1 + 0.1 * t
        else:
            out[name] = t * (t.shape[1] ** -0.5 if t.dim() == 2 else 0.02)
    return out


def hf_logits(
    kind: str, state: dict[str, torch.Tensor], dtype: torch.dtype, ids: torch.Tensor, attn: str = "sdpa"
) -> torch.Tensor:
    """Hugging Face's logits (as float32) for `ids` of the tiny `kind` model (tests.test_megatron_model's
    config) with weights `state`, run in `dtype` on `ids`' device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.test_megatron_model import layout_config

    config = AutoConfig.for_model(kind, **layout_config(kind, {}))
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, strict=False)  # tied heads: lm_head.weight is absent
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(ids.device, dtype).eval()
    with torch.no_grad():
        return model(ids).logits.float()
