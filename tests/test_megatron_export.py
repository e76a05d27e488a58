"""Megatron -> HF streaming for the weight bridge (slime.backends.megatron.export): TP shards
gathered, pipeline stages broadcast to rank 0, HF names; on real gloo groups from megatron-core's
parallel state. Rank 0's stream must equal the original HF checkpoint bit for bit."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from tests.dist_helpers import run_ranks
from tests.test_megatron_convert import tiny


def export_on_ranks(rank, world_size, init_method, kind, tp, pp, bucket_bytes):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from slime.backends.megatron.convert import hf_to_megatron
    from slime.backends.megatron.export import Mesh, export_hf_tensors
    from slime.backends.megatron.rank_files import shard
    from slime.utils.buckets import iter_buckets

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    mesh = Mesh.from_parallel_state()
    layout, hf = tiny(kind, num_hidden_layers=4)
    parts = shard(hf_to_megatron(hf, layout, tp), layout, tp, pp)
    local = parts[(mesh.tp_rank, mesh.pp_rank)]
    buckets = [list(b) for b in iter_buckets(export_hf_tensors(local, layout, mesh), bucket_bytes)]
    got = {n: t.clone() for b in buckets for n, t in b}
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    same = got.keys() == hf.keys() and all(torch.equal(got[k], hf[k]) for k in hf) if got else None
    return {"same": same, "num_buckets": len(buckets), "names": list(got), "dp": mesh.dp_rank}


@pytest.mark.parametrize(
    "kind, tp, pp, world",
    [("qwen3", 2, 2, 4), ("llama", 1, 2, 2), ("qwen2", 2, 1, 4)],  # the last: 2 data-parallel replicas
)
def test_rank_0_streams_the_hf_checkpoint_bit_for_bit(kind, tp, pp, world):
    results = run_ranks(world, export_on_ranks, kind, tp, pp, 40_000)
    assert results[0]["same"] is True and results[0]["num_buckets"] > 3
    assert all(r["same"] is None and r["num_buckets"] == 0 for r in results[1:])  # the others only take part
    names = results[0]["names"]  # HF order: embedding, layers in order, final norm (and head)
    assert names[0] == "model.embed_tokens.weight" and names.index(
        "model.layers.3.mlp.down_proj.weight"
    ) > names.index("model.layers.0.mlp.down_proj.weight")
    assert ("lm_head.weight" in names) == (kind == "llama")
