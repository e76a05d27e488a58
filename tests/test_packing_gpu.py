"""Packed attention on CUDA: torch's flash-attention varlen kernel (half precision) computes what
the per-sample loop computes, forward and backward.

Run on a GPU machine: python -m pytest -m gpu tests/test_packing_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from slime.backends.fsdp import packed_attention

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_kernel_equals_the_per_sample_loop(dtype):
    bounds = [0, 5, 22, 25, 65, 74]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 74, 64, generator=g)
    k, v = torch.randn(1, 2, 74, 64, generator=g), torch.randn(1, 2, 74, 64, generator=g)  # grouped-query
    inputs = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    assert packed_attention._varlen_applies(inputs[0], 0.0)
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    fast = packed_attention.causal_per_segment(*inputs, cu, 40, scale=0.125)
    fast.float().square().sum().backward()
    fast_grads = [t.grad.float() for t in inputs]
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]  # float32: the loop runs
    ref = packed_attention.causal_per_segment(*ref_inputs, cu, scale=0.125)
    ref.square().sum().backward()
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(fast.float(), ref, rtol=tol, atol=tol)
    for got, want in zip(fast_grads, (t.grad for t in ref_inputs)):
        torch.testing.assert_close(got, want, rtol=tol * 5, atol=tol * 5)
