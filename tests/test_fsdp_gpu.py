"""The FSDP actor on CUDA/NCCL (one GPU): numbers match the CPU run, sleep/wake frees memory.

Run on a GPU machine: python -m pytest -m gpu tests/test_fsdp_gpu.py
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import base_config, make_batch

pytestmark = pytest.mark.gpu


def run_device(rank, world_size, init_method, model, device):
    import torch

    from slime.backends.fsdp.actor import FSDPTrainActor

    cfg = dataclasses.replace(base_config(model, micro_batch_size=2), device=device)
    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    actor.init()
    out = {"first": actor.train(0, make_batch(0)).steps}
    if device == "cuda":
        torch.cuda.synchronize()
        out["awake_bytes"] = torch.cuda.memory_allocated()
        actor.sleep()
        out["asleep_bytes"] = torch.cuda.memory_allocated()
        actor.wake()
    out["second"] = actor.train(1, make_batch(1)).steps
    actor.close()
    return out


def test_cuda_matches_cpu_and_sleep_releases_memory(tiny_model):
    cpu = run_ranks(1, run_device, tiny_model, "cpu")[0]
    gpu = run_ranks(1, run_device, tiny_model, "cuda")[0]
    assert gpu["asleep_bytes"] < 0.2 * gpu["awake_bytes"], (gpu["asleep_bytes"], gpu["awake_bytes"])
    for a, b in zip(cpu["first"] + cpu["second"], gpu["first"] + gpu["second"]):
        for name in ("loss", "pg_loss", "entropy", "grad_norm"):
            assert a[name] == pytest.approx(b[name], rel=1e-3, abs=1e-5), name
    assert gpu["first"][0]["ppo_kl"] == 0.0 and gpu["first"][0]["kl_loss"] == 0.0
