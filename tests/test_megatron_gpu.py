"""The Megatron backend on a GPU: megatron-core vs Hugging Face logits on the same converted
weights, the actor on CUDA against the actor on CPU, and two GRPO steps with the torch engine. Run on a GPU machine: `pytest -m gpu tests/test_megatron_gpu.py -s` prints the
max |logit difference| in float32 and bfloat16 for docs/gpu.md."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from tests.test_loop_e2e import prompts  # noqa: E402, F401 - a fixture
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


def test_megatron_actor_on_cuda_trains_like_on_cpu(tiny_model):
    """The Megatron actor on one GPU (megatron-core unpatched) against the same actor on CPU
    (through cpu_shim): the same log-probs, metrics and weights within float32 rounding."""
    from tests.dist_helpers import run_ranks
    from tests.test_megatron_actor import assert_trains_like, train_run

    cpu = run_ranks(1, train_run, tiny_model, 1, 1, "megatron")[0]
    gpu = run_ranks(1, cuda_run, tiny_model)[0]
    assert_trains_like(cpu, [gpu])
    assert gpu["allocated_after_sleep"] < 1 << 20  # sleep moved parameters and optimizer states out


def cuda_run(rank, world_size, init_method, model):
    import dataclasses

    from slime.backends import make_train_actor
    from tests.test_fsdp_actor import make_batch
    from tests.test_megatron_actor import PROBE, ROLLOUTS, config, exported

    actor = make_train_actor(dataclasses.replace(config(model), device="cuda"), rank, world_size, init_method)
    actor.init()
    batch = make_batch(0)
    result = {"lp": actor.compute_log_probs(batch), "outputs": []}
    for r in range(ROLLOUTS):
        result["outputs"].append(actor.train(r, make_batch(r)))
        if r == 0:
            result["probe"] = actor.compute_log_probs(make_batch(PROBE))
    result["weights"] = {k: v.cpu() for k, v in exported(actor).items()}
    actor.sleep()
    result["allocated_after_sleep"] = torch.cuda.memory_allocated()
    actor.close()
    return result


@pytest.mark.parametrize(
    "layout",
    [
        ["--colocate", "--update-weight-transport", "disk"],
        ["--colocate", "--update-weight-transport", "tensor", "--bf16"],
        ["--rollout-num-gpus", "1", "--update-weight-transport", "distributed"],
    ],
    ids=["colocated-disk", "colocated-cuda-ipc-bf16", "disaggregated"],
)
def test_two_grpo_steps_with_the_megatron_backend(tiny_model, prompts, tmp_path, layout):  # noqa: F811
    """Issue 9's GPU run: two GRPO steps, Megatron backend, torch engine, step-0 gates on."""
    if torch.cuda.device_count() < (1 if "--colocate" in layout else 2):
        pytest.skip("not enough GPUs for this layout")
    from tests.test_loop_e2e import run_job

    proc = run_job("train.py", tiny_model, prompts, tmp_path, "--rm-type", "exact", "--device", "cuda",
                   "--train-backend", "megatron", "--rollout-backend", "torch", "--transformer-impl", "local", "--advantage-estimator", "grpo", "--use-kl-loss",
                   "--kl-loss-coef", "0.01", "--check-precision", "--check-weight-update-equal", *layout)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "--check-precision: passed at rollout 0" in proc.stderr
    assert "after the first push every engine parameter equals the checkpoint" in proc.stderr
