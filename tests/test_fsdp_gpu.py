"""The FSDP actor on CUDA/NCCL (one GPU): numbers match the CPU run, sleep/wake frees memory.

Run on a GPU machine: python -m pytest -m gpu tests/test_fsdp_gpu.py -s
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.dist_helpers import run_ranks
from tests.gpu_memory import assert_released, run_checks
from tests.test_fsdp_actor import base_config, make_batch

pytestmark = pytest.mark.gpu


def run_device(rank, world_size, init_method, model, device):
    import torch

    from slime.backends.fsdp.actor import FSDPTrainActor
    from tests import gpu_memory

    if device == "cuda":
        gpu_memory.record_allocations()
    cfg = dataclasses.replace(base_config(model, micro_batch_size=2), device=device)
    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    actor.init()
    out = {"first": actor.train(0, make_batch(0)).steps}
    if device == "cuda":
        torch.cuda.synchronize()
        out["awake_bytes"] = torch.cuda.memory_allocated()
        actor.sleep()
        out["left"] = gpu_memory.left_on_device()
        out["pageable"] = pageable_host_tensors(actor)
        out["fused"] = actor.backend.optimizer.defaults.get("fused")
        actor.wake()
    out["second"] = actor.train(1, make_batch(1)).steps
    actor.close()
    return out


def pageable_host_tensors(actor) -> list[str]:
    """What sleep left in pageable host memory (slow to copy: every offloaded tensor should be
    pinned), and any gradient it kept."""
    from slime.backends.fsdp.model_init import local_tensor

    backend = actor.backend
    bad = [n for n, p in backend.model.named_parameters() if not local_tensor(p).is_pinned()]
    bad += [f"{n}.grad" for n, p in backend.model.named_parameters() if p.grad is not None]
    for i, state in enumerate(backend.optimizer.state.values()):
        bad += [f"state {i} {k}" for k, v in state.items() if v.dim() > 0 and not local_tensor(v).is_pinned()]
    return bad


def test_cuda_matches_cpu_and_sleep_releases_memory(tiny_model):
    cpu = run_ranks(1, run_device, tiny_model, "cpu")[0]
    gpu = run_ranks(1, run_device, tiny_model, "cuda")[0]
    assert gpu["awake_bytes"] > 0

    def same_numbers() -> None:
        for step, (a, b) in enumerate(zip(cpu["first"] + cpu["second"], gpu["first"] + gpu["second"])):
            for name in ("loss", "pg_loss", "entropy", "grad_norm"):
                assert a[name] == pytest.approx(b[name], rel=1e-3, abs=1e-5), (step, name, a[name], b[name])
        assert gpu["first"][0]["ppo_kl"] == 0.0 and gpu["first"][0]["kl_loss"] == 0.0

    def pinned_and_fused() -> None:
        assert gpu["pageable"] == [], gpu["pageable"]
        assert gpu["fused"] is True  # AdamW's fused kernel on the DTensor shards

    run_checks(
        lambda: assert_released(gpu["left"], f"FSDP actor ({gpu['awake_bytes']:,} B allocated awake)"),
        same_numbers,
        pinned_and_fused,
    )


def test_compiled_layers_train_as_the_eager_ones_on_cuda(tiny_model):
    """--fsdp-torch-compile on CUDA (Inductor's Triton kernels, NCCL): the eager run's losses,
    gradient norms and log-probs, float32."""
    from tests.test_fsdp_compile import assert_same_training, train_rollouts

    eager, eager_lp, _ = run_ranks(1, train_rollouts, tiny_model, False, False, "cuda")[0]
    compiled, compiled_lp, graphs = run_ranks(1, train_rollouts, tiny_model, True, False, "cuda")[0]
    assert graphs > 0
    assert_same_training(compiled, eager, compiled_lp, eager_lp, rel=1e-3, lp_abs=1e-4)
