"""Packed attention on CUDA: torch's flash-attention varlen kernel (half precision) computes what
the per-sample loop computes, forward and backward, with grouped-query heads.

Run on a GPU machine: python -m pytest -m gpu tests/test_packing_gpu.py -s
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

from slime.backends import packed_attention

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_kernel_equals_the_per_sample_loop(dtype, monkeypatch):
    kernel = packed_attention._varlen_kernel()
    assert kernel is not None, f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    about = f"torch {torch.__version__}, varlen_attn{inspect.signature(kernel)}"
    print(about)
    calls = []

    @functools.wraps(kernel)  # the call plan reads the signature through __wrapped__
    def counted(*args, **kwargs):
        calls.append(sorted(kwargs))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(packed_attention, "_varlen_kernel", lambda: counted)
    bounds = [0, 5, 22, 25, 65, 74]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 74, 64, generator=g)
    k, v = torch.randn(1, 2, 74, 64, generator=g), torch.randn(1, 2, 74, 64, generator=g)  # grouped-query
    inputs = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    assert packed_attention._varlen_applies(inputs[0], 0.0), (about, torch.cuda.get_device_capability())
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    fast = packed_attention.causal_per_segment(*inputs, cu, 40, scale=0.125)
    # every torch since 2.10 takes this call (a causal keyword; 0.125 is the default scale at head
    # dimension 64): the kernel ran, not the per-segment loop
    assert len(calls) == 1, f"the varlen kernel was not called ({about})"
    print(f"{dtype}: varlen_attn called with keywords {calls[0]}")
    fast.float().square().sum().backward()
    fast_grads = [t.grad.float() for t in inputs]
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]  # float32: the loop runs
    ref = packed_attention.causal_per_segment(*ref_inputs, cu, scale=0.125)
    ref.square().sum().backward()
    assert len(calls) == 1, "float32 ran the kernel"
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(fast.float(), ref, rtol=tol, atol=tol, msg=lambda m: f"output ({about}): {m}")
    for name, got, want in zip("qkv", fast_grads, (t.grad for t in ref_inputs)):
        torch.testing.assert_close(
            got, want, rtol=tol * 5, atol=tol * 5, msg=lambda m, name=name: f"d{name} ({about}): {m}"
        )
