"""Trainer → engine: after a push from a two-rank FSDP actor every engine parameter equals the trainer's."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import start_engine
from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import base_config, make_batch


def train_and_push(
    rank, world_size, init_method, model, url, transport, more_urls=(), megatron_tp=0, megatron_ep=0
):
    from slime.backends import make_train_actor
    from slime.bridge.bridge import WeightBridge
    from slime.bridge.push import push_actor_weights
    from slime.bridge.topology import build_topology
    from slime.engines.client import EngineClient
    from slime.utils.checksum import tensor_checksum

    if megatron_tp or megatron_ep:
        import dataclasses

        from slime.config.train import MegatronConfig
        from tests.test_megatron_actor import config

        cfg = config(model, tp=megatron_tp or 1)
        if megatron_ep:
            cfg = dataclasses.replace(cfg, megatron=MegatronConfig(expert_model_parallel_size=megatron_ep))
    else:
        cfg = base_config(model, micro_batch_size=2)
    actor = make_train_actor(cfg, rank, world_size, init_method)
    actor.init()
    actor.train(0, make_batch(0))
    # Every rank on this machine; with `ipc`, engine j is fed by train rank j.
    topology = build_topology(transport, "cpu", [url, *more_urls], train_nodes=["127.0.0.1"] * world_size)
    bridge = WeightBridge.for_topology(topology, model) if rank == 0 else None
    stats = push_actor_weights(actor, bridge, "step-1", bucket_bytes=250_000, topology=topology)
    # What this rank holds in HF names (Megatron: assembled on every rank, as the IPC push does).
    trainer = {n: tensor_checksum(t) for b in actor.export_weights(1 << 30, every_rank=True) for n, t in b}
    engine = None
    if rank == 0:

        async def read(u):
            async with EngineClient(u) as c:
                return await c.weights_checksum()

        engine = asyncio.run(read(url))
        for u in more_urls:
            assert asyncio.run(read(u)) == engine
        asyncio.run(bridge.close())
    actor.close()
    return {"stats": stats, "trainer": trainer, "engine": engine}


# The MoE push is also fingerprinted end to end in tests/test_moe_e2e.py (--check-precision); the
# distributed transport's push after training in tests/test_cluster_e2e.py (two nodes, --check-weight-sync).
@pytest.mark.parametrize(
    "transport",
    [
        "tensor",
        pytest.param("distributed", marks=pytest.mark.slow),
        pytest.param("moe-distributed", marks=pytest.mark.slow),
    ],
)
def test_push_after_training_makes_engine_equal_trainer(tiny_model, tiny_moe, tmp_path, transport):
    """With the Qwen3-MoE model the fused experts travel as per-expert checkpoint tensors and
    the engine writes each into its own fused parameter."""
    model = tiny_moe if transport.startswith("moe-") else tiny_model
    transport = transport.removeprefix("moe-")
    proc = start_engine(model, tmp_path)
    try:
        rank0, rank1 = run_ranks(2, train_and_push, model, proc.url, transport)
    finally:
        proc.stop()
    assert rank1["stats"] is None and rank0["stats"]["buckets"] > 1
    assert (
        rank0["stats"]["transport"]
        == {"tensor": "shared_memory", "distributed": "distributed_gloo"}[transport]
    )
    assert rank0["engine"]["weight_version"] == "step-1"
    assert rank0["engine"]["checksums"] == rank0["trainer"] == rank1["trainer"]
    if model == tiny_moe:
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in rank0["trainer"]


@pytest.mark.parametrize(
    "megatron",
    # moe-ep2 (~14 s): the experts' gathering on every rank is also what tests/test_megatron_moe_actor.py
    # compares with one FSDP rank's export; fsdp (~14 s): the same handles and buckets as tp2's (FSDP's
    # every-rank export also runs in tests/test_lora.py's adapter push and ran over CUDA IPC on a GPU)
    [pytest.param("", marks=pytest.mark.slow), "tp2", pytest.param("moe-ep2", marks=pytest.mark.slow)],
    ids=["fsdp", "megatron-tp2", "megatron-moe-ep2"],
)
def test_flattened_bucket_push_shares_each_ranks_copy_by_handle(tiny_model, tiny_moe, tmp_path, megatron):
    """The CUDA-IPC push's code path (slime.bridge.ipc) with CPU buffers shared by file: two train
    ranks, two engines; engine j opens rank j's buffer (the GPU case: engine j on rank j's GPU).
    With the Megatron actor at TP 2 each rank holds half of each matrix, and with the Qwen3-MoE
    model at EP 2 half of each layer's experts: the push assembles the full tensors on both ranks."""
    if megatron:
        pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    model = tiny_moe if megatron == "moe-ep2" else tiny_model
    tp, ep = (2, 0) if megatron == "tp2" else (0, 2) if megatron == "moe-ep2" else (0, 0)
    engines = [start_engine(model, tmp_path) for _ in range(2)]
    try:
        rank0, rank1 = run_ranks(2, train_and_push, model, engines[0].url, "ipc", [engines[1].url], tp, ep)
    finally:
        for e in engines:
            e.stop()
    assert rank1["stats"] is None and rank0["stats"]["buckets"] > (1 if model == tiny_moe else 3)
    assert rank0["stats"]["transport"] == "cpu_ipc"
    assert rank0["engine"]["weight_version"] == "step-1"
    assert rank0["engine"]["checksums"] == rank0["trainer"] == rank1["trainer"]
    if model == tiny_moe:
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in rank0["trainer"]
