"""`--fsdp-torch-compile`: the decoder layers compiled train as the eager ones, with one set of
compiled graphs shared by every layer (on CPU: Inductor's C++ kernels; the GPU's Triton kernels
wait for a GPU run, docs/gpu.md)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import make_model
from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import base_config, make_batch


def train_rollouts(
    rank, world_size, init_method, model, compile_layers, checkpointing=False, device="cpu", lora=False
):
    """Two rollouts of two optimizer steps each (packed micro-batches of 2 samples, so the token
    count changes from one micro-batch to the next): each step's metrics, the log-probs of a
    third batch after them, and Dynamo's count of the graphs it compiled. With `lora`, rank-4
    adapters on every linear layer train instead, and the log-probs are the trained ones and the
    reference's (the adapters off)."""
    import torch
    from torch._dynamo.utils import counters

    from slime.backends.fsdp.actor import FSDPTrainActor
    from slime.config.backends import FSDPConfig
    from slime.config.lora import LoRAConfig

    torch._dynamo.reset()
    fsdp = FSDPConfig(torch_compile=compile_layers, gradient_checkpointing=checkpointing)
    cfg = dataclasses.replace(base_config(model, micro_batch_size=2), fsdp=fsdp, device=device)
    if lora:
        cfg = dataclasses.replace(cfg, lora=LoRAConfig(rank=4, alpha=8, target_modules=("all-linear",)))
    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    actor.init()
    steps = [step for r in range(2) for step in actor.train(r, make_batch(r)).steps]
    log_probs = actor.compute_log_probs(make_batch(7))
    if lora:
        log_probs = (log_probs, actor.compute_log_probs(make_batch(7), use_reference=True))
    actor.close()
    return steps, log_probs, counters["stats"]["unique_graphs"]


def assert_same_training(compiled, eager, compiled_lp, eager_lp, rel=1e-4, lp_abs=1e-5) -> None:
    assert len(compiled) == len(eager) == 4
    for got, want in zip(compiled, eager):
        for name in ("loss", "pg_loss", "kl_loss", "grad_norm"):
            assert got[name] == pytest.approx(want[name], rel=rel, abs=1e-6), name
    for p, want in eager_lp.items():
        assert compiled_lp[p] == pytest.approx(want, abs=lp_abs)


@pytest.mark.slow
def test_compiled_layers_train_as_the_eager_ones_from_one_set_of_graphs(tmp_path):
    two = make_model(str(tmp_path / "two-layers"), 0, "--num-layers", "2")
    six = make_model(str(tmp_path / "six-layers"), 0, "--num-layers", "6")
    eager, eager_lp, eager_graphs = run_ranks(1, train_rollouts, two, False)[0]
    compiled, compiled_lp, graphs = run_ranks(1, train_rollouts, two, True)[0]
    assert eager_graphs == 0 and graphs > 0
    assert_same_training(compiled, eager, compiled_lp, eager_lp)
    # Three times the layers, the same graphs: the layers share them (their parameters are
    # inputs), and the micro-batches' changing lengths compiled a dynamic graph once.
    assert run_ranks(1, train_rollouts, six, True)[0][2] == graphs
    # Recomputing each layer in backward (transformers' checkpointing inside the compiled
    # forward) changes no value either.
    recomputed, _, _ = run_ranks(1, train_rollouts, two, True, True)[0]
    for got, want in zip(recomputed, eager):
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_compiled_layers_with_lora_adapters_train_as_the_eager_ones(tmp_path):
    """LoRA's adapters inside the compiled layers: the same steps, and the same reference
    log-probs with the adapters switched off (a flag the compiled code is guarded on)."""
    two = make_model(str(tmp_path / "two-layers"), 0, "--num-layers", "2")
    eager, (eager_lp, eager_ref), _ = run_ranks(1, train_rollouts, two, False, False, "cpu", True)[0]
    compiled, (compiled_lp, compiled_ref), graphs = run_ranks(
        1, train_rollouts, two, True, False, "cpu", True
    )[0]
    assert graphs > 0
    trained = [abs(a - b) for p in eager_lp for a, b in zip(eager_lp[p], eager_ref[p])]
    assert max(trained) > 1e-3  # the adapters trained: switching them off shows
    assert_same_training(compiled, eager, compiled_lp, eager_lp)
    assert_same_training(compiled, eager, compiled_ref, eager_ref)


def train_without_a_compiler(rank, world_size, init_method, model):
    """One train call with --fsdp-torch-compile and no C++ compiler for Inductor."""
    import torch._inductor.config as inductor

    from slime.backends.fsdp.actor import FSDPTrainActor
    from slime.config.backends import FSDPConfig

    inductor.cpp.cxx = (None, "/nonexistent/c++")
    cfg = dataclasses.replace(base_config(model, micro_batch_size=2), fsdp=FSDPConfig(torch_compile=True))
    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    actor.init()
    try:
        actor.train(0, make_batch(0))
    finally:
        actor.close()


@pytest.mark.slow
def test_a_compiler_that_fails_names_the_flag_and_the_way_out(tiny_model):
    with pytest.raises(Exception) as failed:
        run_ranks(1, train_without_a_compiler, tiny_model)
    message = str(failed.value)
    assert "--fsdp-torch-compile: torch.compile could not build the kernels of " in message
    assert "Qwen3DecoderLayer: " in message  # (FSDP2's class of the layer: FSDPQwen3DecoderLayer)
    assert "No working C++ compiler" in message and "Run without --fsdp-torch-compile" in message


def test_the_flag_refuses_layers_it_cannot_compile(tiny_model, tiny_moe, tmp_path, capsys):
    """Mixture-of-experts layers (transformers' expert loop depends on the data) are refused by
    name at parse time, not found out after a rollout; a dense model takes the flag."""
    import json

    from slime.ray.cli import parse_args

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")

    def argv(model: str) -> list[str]:
        return [
            *("--hf-checkpoint", model, "--prompt-data", str(prompts), "--rm-type", "exact"),
            *("--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1"),
            "--fsdp-torch-compile",
        ]

    assert parse_args(argv(tiny_model)).train.fsdp.torch_compile
    with pytest.raises(SystemExit) as e:
        parse_args(argv(tiny_moe))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--fsdp-torch-compile with" in err and "mixture-of-experts" in err, err
