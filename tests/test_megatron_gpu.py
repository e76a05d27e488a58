"""megatron-core vs Hugging Face logits on the same converted weights (needs CUDA: megatron-core's
forward assumes it). Run on a GPU machine: `pytest -m gpu tests/test_megatron_gpu.py -s` prints the
max |logit difference| in float32 and bfloat16 for docs/gpu.md."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from tests.test_megatron_convert import tiny  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_megatron_logits_match_hf_on_converted_weights(kind, dtype):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime.backends.megatron.convert import hf_to_megatron
    from slime.backends.megatron.model import build_gpt_model, model_state, transformer_config
    from tests.test_megatron_model import layout_config

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    try:
        layout, hf_state = tiny(kind)
        hf_config = AutoConfig.for_model(kind, **layout_config(kind, {}))
        hf = AutoModelForCausalLM.from_config(hf_config)
        hf.load_state_dict(hf_state, strict=False)
        if layout.tied_embeddings:
            hf.tie_weights()
        hf = hf.to("cuda", dtype).eval()
        config = transformer_config(layout, hf_config, params_dtype=dtype, tensor_model_parallel_size=1,
                                    pipeline_model_parallel_size=1, bf16=dtype == torch.bfloat16)  # fmt: skip
        model = build_gpt_model(layout, hf_config, config, tp=1).to("cuda").eval()
        converted = {k: v.to(dtype) for k, v in hf_to_megatron(hf_state, layout, 1).items()}
        missing = model.load_state_dict(converted, strict=False).missing_keys
        assert not [k for k in missing if not k.endswith("._extra_state")] and set(model_state(model)) == set(
            converted
        )
        ids = torch.randint(
            0, layout.vocab_size, (2, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(0)
        )
        pos = torch.arange(24, device="cuda").expand(2, -1)
        mask = torch.triu(torch.ones(24, 24, dtype=torch.bool, device="cuda"), diagonal=1)[None, None]
        with torch.no_grad():
            want = hf(ids).logits.float()
            got = model(ids, pos, attention_mask=mask)[..., : layout.vocab_size].float()
        diff = (got - want).abs().max().item()
        print(f"{kind} {dtype}: max |megatron - hf| logit = {diff:.3g}")
        assert diff < TOLERANCE[dtype]
    finally:
        parallel_state.destroy_model_parallel()
