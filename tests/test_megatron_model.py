"""Converted checkpoints load into megatron-core GPTModels built on CPU (use_cpu_initialization),
on real gloo process groups with megatron-core's parallel state: TP 1, TP 2 and TP 2 x PP 2
(untied and tied embeddings). Names and shapes must match exactly."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from tests.dist_helpers import run_ranks
from tests.test_megatron_convert import tiny


def build_and_load(rank, world_size, init_method, kind, tp, pp, over):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from slime.backends.megatron.convert import hf_to_megatron
    from slime.backends.megatron.model import build_gpt_model, model_state, transformer_config
    from slime.backends.megatron.rank_files import shard

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    from slime.backends.megatron import cpu_shim

    cpu_shim.enable()  # tied embeddings with PP > 1 move the last stage's copy with .cuda()
    layout, hf = tiny(kind, **over)
    parts = shard(hf_to_megatron(hf, layout, tp), layout, tp, pp)
    mine = parts[
        (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
    ]
    hf_config = AutoConfig.for_model(kind, **layout_config(kind, over))
    config = transformer_config(
        layout, hf_config, cpu_init=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    model = build_gpt_model(layout, hf_config, config, tp)
    built = {k: tuple(v.shape) for k, v in model_state(model).items()}
    result = model.load_state_dict(mine, strict=False)
    loaded = model_state(model)
    same = all(torch.equal(loaded[k], mine[k]) for k in mine if k in loaded)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return {
        "built": built,
        "converted": {k: tuple(v.shape) for k, v in mine.items()},
        "missing": [k for k in result.missing_keys if not k.endswith("._extra_state")],
        "unexpected": list(result.unexpected_keys),
        "same": same,
        "inv_freq": model.rotary_pos_emb.inv_freq.clone() if hasattr(model, "rotary_pos_emb") else None,
    }


def layout_config(kind: str, over: dict) -> dict:
    from tests.test_megatron_convert import COMMON

    extra = {"head_dim": 16} if kind == "qwen3" else {}
    return {**COMMON, **over, **extra, "tie_word_embeddings": kind != "llama"}


@pytest.mark.parametrize(
    "kind, tp, pp",
    [
        ("qwen3", 1, 1),
        ("qwen2", 2, 1),
        ("llama", 2, 2),
        # Tied embeddings with PP > 1: the last stage holds a copy of the embedding, all-reduced with
        # the first stage's at construction (megatron-core moves it with .cuda(): cpu_shim).
        ("qwen3", 2, 2),
    ],
)
def test_converted_shards_load_into_megatron_core_exactly(kind, tp, pp):
    results = run_ranks(tp * pp, build_and_load, kind, tp, pp, {"num_hidden_layers": 4})
    for r in results:
        assert r["built"] == r["converted"], (sorted(set(r["built"]) ^ set(r["converted"])), r)
        assert r["missing"] == [] and r["unexpected"] == [] and r["same"]


def test_the_rotary_base_comes_from_the_hf_config():
    """A Qwen3 with rope base 1e6 (as real Qwen3 checkpoints have) gets megatron-core's rotary
    table for 1e6, not its default 10000."""
    import torch

    result = run_ranks(1, build_and_load, "qwen3", 1, 1, {"num_hidden_layers": 4, "rope_theta": 1e6})[0]
    expected = 1.0 / (1e6 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    torch.testing.assert_close(result["inv_freq"].float().cpu(), expected)


def dropout_draws(rank, world_size, init_method):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from slime.backends.megatron import cpu_shim
    from slime.backends.megatron.model import build_gpt_model, transformer_config

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel()
    cpu_shim.enable()
    layout, _ = tiny("qwen3", num_hidden_layers=2)
    hf_config = AutoConfig.for_model("qwen3", **layout_config("qwen3", {"num_hidden_layers": 2}))
    # Attention dropout only: it runs in the tensor-parallel random state (hidden dropout would draw
    # from the default stream and hide a tracker that repeats its state).
    config = transformer_config(layout, hf_config, cpu_init=True, attention_dropout=0.5, hidden_dropout=0.0)
    model = build_gpt_model(layout, hf_config, config, 1)
    ids = torch.arange(1, 9).unsqueeze(0)
    pos = torch.arange(8).unsqueeze(0)

    def forward() -> torch.Tensor:
        return model(input_ids=ids, position_ids=pos, attention_mask=None).detach()

    def seeded() -> None:
        torch.manual_seed(7)
        cpu_shim.seed(7, parallel_state.get_tensor_model_parallel_rank())

    model.train()
    seeded()
    first, second = forward(), forward()
    seeded()
    again = forward()
    model.eval()
    plain = forward()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return {"first": first, "second": second, "again": again, "plain": plain}


def test_dropout_draws_new_masks_on_cpu_and_repeats_under_the_same_seed():
    """The CPU random-state tracker advances its states from one dropout region to the next (a
    restored state would repeat every mask), and megatron-core's seeding reproduces them."""
    import torch

    (r,) = run_ranks(1, dropout_draws)
    assert not torch.equal(r["first"], r["plain"])  # dropout acted in training mode
    assert not torch.equal(r["first"], r["second"])  # ... with new masks on the next forward
    assert torch.equal(r["first"], r["again"])  # ... and the same ones under the same seed
