"""The megatron-core vs Hugging Face logit comparison's tolerance (tests/logit_tolerance.py), on
CPU: it accepts what the first GPU run measured of two correct models, and another correct
bfloat16 implementation; it rejects TF32 in a float32 comparison and a genuinely wrong model."""

from __future__ import annotations

import pytest
import torch

from tests.logit_tolerance import hf_logits, logits_agree, realistic_scale
from tests.test_megatron_convert import tiny

LARGEST = 36.0  # the first GPU run's largest |logit| (N(0, 1) weights)


def logits_off_by(error: float) -> tuple[torch.Tensor, torch.Tensor]:
    want = torch.linspace(-LARGEST, LARGEST, 101, dtype=torch.float64).repeat(2, 24, 1)
    got = want.clone()
    got[1, 7, 3] += error
    return got, want


@pytest.mark.parametrize("error", [2.6e-4, 4.7e-5, 1.0e-4])  # qwen2 / qwen3 / llama, TF32 off
def test_float32_accepts_the_measured_differences(error):
    verdict = logits_agree(*logits_off_by(error), torch.float32)
    assert verdict and verdict.error == pytest.approx(error, rel=1e-3), verdict.summary


@pytest.mark.parametrize("error", [0.062, 0.024, 0.014])  # the same with TF32 matmuls
def test_float32_rejects_tf32(error):
    verdict = logits_agree(*logits_off_by(error), torch.float32)
    assert not verdict, verdict.summary


@pytest.mark.parametrize("megatron, hf", [(7.3, 11.8), (1.22, 1.75), (13.0, 8.18)])
def test_bfloat16_accepts_the_measured_errors(megatron, hf):
    """Megatron bf16 vs HF fp32, and HF bf16 vs HF fp32, as the first GPU run measured them."""
    verdict = logits_agree(*logits_off_by(megatron), torch.bfloat16, reference_error=hf)
    assert verdict, verdict.summary


def test_bfloat16_rejects_an_error_of_the_logits_size_and_needs_the_reference():
    assert not logits_agree(*logits_off_by(30.0), torch.bfloat16, reference_error=8.18)
    assert not logits_agree(*logits_off_by(0.5), torch.bfloat16, reference_error=0.0)  # 0.5 > 36 x 2^-8
    with pytest.raises(ValueError, match="reference"):
        logits_agree(*logits_off_by(0.0), torch.bfloat16)


def swapped_key_heads(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A conversion bug: every layer's first two key heads trade places."""
    out = dict(state)
    for name in [n for n in state if n.endswith("k_proj.weight")]:
        d = state[name].shape[0] // 4  # COMMON: 4 key/value heads
        out[name] = torch.cat([state[name][d : 2 * d], state[name][:d], state[name][2 * d :]])
    return out


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_real_models_at_realistic_scale(kind):
    """HF's eager attention is a second correct implementation (accepted, in float32 and
    bfloat16); the same model with swapped key heads a wrong one (rejected in both)."""
    _, state = tiny(kind)
    state = realistic_scale(state)
    ids = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(0))
    want = hf_logits(kind, state, torch.float32, ids)
    reference_error = (hf_logits(kind, state, torch.bfloat16, ids) - want).abs().max().item()
    for dtype, reference in [(torch.float32, None), (torch.bfloat16, reference_error)]:
        good = logits_agree(hf_logits(kind, state, dtype, ids, "eager"), want, dtype, reference)
        bad = logits_agree(hf_logits(kind, swapped_key_heads(state), dtype, ids), want, dtype, reference)
        assert good, good.summary
        assert not bad and bad.error > 5 * bad.allowed, bad.summary  # by far, not by chance
