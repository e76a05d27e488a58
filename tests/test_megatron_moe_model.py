"""A converted Qwen3-MoE checkpoint in megatron-core's GPTModel (its MoE layer, router and
all-to-all token dispatcher, on CPU over gloo) gives Hugging Face's logits, with the experts on
one rank and split over two expert-parallel ranks (and over PP 2 x EP 2)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from tests.dist_helpers import run_ranks
from tests.test_megatron_moe_convert import MOE, tiny_moe


def forward_ranks(rank, world_size, init_method, tp, pp, ep):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from slime.backends.megatron import cpu_shim
    from slime.backends.megatron.model import build_gpt_model, model_state, transformer_config
    from slime.backends.megatron.sharding import hf_to_megatron_shard

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )
    cpu_shim.enable()
    cpu_shim.seed(0, ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank())
    layout, hf = tiny_moe()
    hf_config = Qwen3MoeConfig(**MOE)
    config = transformer_config(
        layout,
        hf_config,
        cpu_init=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        variable_seq_lengths=True,
    )
    model = build_gpt_model(layout, hf_config, config, tp)
    mine = hf_to_megatron_shard(
        hf,
        layout,
        tp,
        pp,
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ep,
        1,
        ps.get_expert_model_parallel_rank(),
        0,
    )
    built = {k: tuple(v.shape) for k, v in model_state(model).items()}
    result = model.load_state_dict(mine, strict=False)
    model.eval()
    torch.manual_seed(1)
    ids = torch.randint(0, MOE["vocab_size"], (2, 12))
    with torch.no_grad():
        if pp == 1:
            logits = model(ids, torch.arange(12).expand(2, 12), None)
        else:  # run the two stages by hand: stage 0's hidden states to stage 1
            model.set_input_tensor(None)
            if ps.is_pipeline_first_stage():
                hidden = model(ids, torch.arange(12).expand(2, 12), None)
                dist.send(hidden.contiguous(), dst=rank + world_size // 2)
                logits = None
            else:
                hidden = torch.empty(12, 2, MOE["hidden_size"])
                dist.recv(hidden, src=rank - world_size // 2)
                model.set_input_tensor(hidden)
                logits = model(ids, torch.arange(12).expand(2, 12), None)
    reference = None
    if rank == world_size - 1:
        hf_model = AutoModelForCausalLM.from_config(hf_config).eval()
        from slime.utils.hf_experts import checkpoint_tensors

        fused = {n: p for n, p in hf_model.state_dict().items()}
        views = dict(checkpoint_tensors("qwen3_moe", fused.items()))
        with torch.no_grad():
            for name, view in views.items():
                view.copy_(hf[name])
            reference = hf_model(ids).logits
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return {
        "built": built,
        "mine": {k: tuple(v.shape) for k, v in mine.items()},
        "missing": [k for k in result.missing_keys if not k.endswith("._extra_state")],
        "unexpected": list(result.unexpected_keys),
        "logits": logits,
        "reference": reference,
    }


@pytest.mark.parametrize("tp, pp, ep", [(1, 1, 1), (1, 1, 2), (1, 2, 2)])
def test_megatron_moe_forward_equals_hugging_face(tp, pp, ep):
    results = run_ranks(max(tp, ep) * pp, forward_ranks, tp, pp, ep)
    for r in results:
        assert r["built"] == r["mine"], sorted(set(r["built"]) ^ set(r["mine"]))
        assert r["missing"] == [] and r["unexpected"] == []
    last = results[-1]
    vocab = MOE["vocab_size"]
    got = last["logits"][..., :vocab]
    assert got.shape == last["reference"].shape
    assert (got - last["reference"]).abs().max() < 1e-4
