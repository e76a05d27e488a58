"""PPO's critic on megatron-core (slime.backends.megatron.critic) on real gloo process groups,
against the FSDP critic on one rank (tests/test_critic.py tests that one against Hugging Face).

The tiny checkpoint ties its embeddings; the critic never does (its head is a value head): every
layout must give the FSDP critic's values, step metrics and rollout metrics within float32
rounding, and its first step's values must equal its value pass bitwise (--check-precision).
Its checkpoint resumes bit for bit, its --save-hf export is a token classifier either backend's
critic starts from, and the conversion tools refuse its checkpoints by name.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from tests.dist_helpers import run_ranks
from tests.test_critic import critic_run, fake_returns
from tests.test_fsdp_actor import base_config, make_batch
from tests.test_megatron_actor import config


def _everyone(per_rank: dict) -> dict:
    """The answers of every rank merged (a replica's ranks answer once between them)."""
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, per_rank)
    return {k: v for part in gathered for k, v in part.items()}


def megatron_critic_run(
    rank, world_size, init_method, model, tp, pp, save_dir=None, hf_dir=None, load=None, critic_load=None
):
    """Two rollouts of one value step each (as tests/test_critic.py's critic_run); with
    `save_dir` a checkpoint after rollout 0, with `load` a resumed run of rollout 1."""
    from slime.backends import make_train_actor

    cfg = dataclasses.replace(config(model, tp, pp), check_precision=True, load=load)
    if critic_load:
        cfg = dataclasses.replace(cfg, hf_checkpoint=critic_load)
    critic = make_train_actor(cfg, rank, world_size, init_method, critic=True)
    info = critic.init()
    mine = critic.compute_values(make_batch(0))
    result = {"info": info, "answered": bool(mine), "values": _everyone(mine), "outputs": []}
    first = 0 if info["resumed_rollout_id"] is None else info["resumed_rollout_id"] + 1
    for r in range(first, 2):
        batch = make_batch(r)
        old = _everyone(critic.compute_values(batch))
        result["outputs"].append(critic.train_values(r, batch, old, fake_returns(batch, r)))
        if save_dir and r == 0:
            critic.save(r, save_dir)
    result["after"] = _everyone(critic.compute_values(make_batch(0)))
    if hf_dir:
        critic.save_hf(hf_dir)
    critic.close()
    return result


@pytest.fixture(scope="module")
def fsdp(tiny_model):
    return run_ranks(1, critic_run, tiny_model)[0]


@pytest.fixture(scope="module")
def tp2(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_critic")
    save_dir, hf_dir = str(out / "ckpt"), str(out / "hf")
    return save_dir, hf_dir, run_ranks(2, megatron_critic_run, tiny_model, 2, 1, save_dir, hf_dir)


def assert_values_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for index, values in a.items():
        torch.testing.assert_close(torch.tensor(b[index]), torch.tensor(values), rtol=0, atol=atol)


def assert_trains_like(fsdp, ranks):
    for result in ranks:
        assert_values_close(fsdp["values"], result["values"], 1e-6)
        for a, b in zip(fsdp["outputs"], result["outputs"], strict=True):
            for sa, sb in zip(a.steps, b.steps, strict=True):
                assert sa.keys() == sb.keys() == {"value_loss", "value_clipfrac", "grad_norm", "lr"}
                for key in sa:
                    assert sb[key] == pytest.approx(sa[key], rel=2e-5, abs=1e-6), key
            assert a.rollout.keys() == b.rollout.keys()
            for key, value in a.rollout.items():
                assert b.rollout[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
            assert b.precision == {"critic_first_step_max_abs_diff": 0.0}
        assert_values_close(fsdp["after"], result["after"], 3e-5)


def test_tp2_critic_trains_like_one_fsdp_rank(fsdp, tp2):
    assert_trains_like(fsdp, tp2[2])


@pytest.mark.parametrize("tp, pp, world", [(1, 2, 2), (2, 2, 4), (1, 1, 2)], ids=["pp2", "tp2xpp2", "dp2"])
def test_other_layouts_train_like_one_fsdp_rank(fsdp, tiny_model, tp, pp, world):
    """The head is on the last stage only. One rank of each replica answers the values, TP rank 0
    of the last stage (megatron-core's rank order: TP, then DP, then PP; the job merges the
    answers)."""
    ranks = run_ranks(world, megatron_critic_run, tiny_model, tp, pp)
    dp = world // (tp * pp)
    assert [r["answered"] for r in ranks] == [r % tp == 0 and r // (tp * dp) == pp - 1 for r in range(world)]
    assert_trains_like(fsdp, ranks)


def test_a_critic_checkpoint_resumes_bit_for_bit(tiny_model, tp2):
    save_dir, _, ranks = tp2
    resumed = run_ranks(2, megatron_critic_run, tiny_model, 2, 1, None, None, save_dir)
    assert resumed[0]["info"]["resumed_rollout_id"] == 0
    assert resumed[0]["outputs"][0].steps == ranks[0]["outputs"][1].steps
    assert resumed[0]["after"] == ranks[0]["after"]


def test_the_export_is_a_token_classifier_either_critic_starts_from(tiny_model, tp2, tmp_path):
    """--save-hf: AutoModelForTokenClassification loads it and gives the critic's values; the
    FSDP critic and a PP 2 Megatron critic started from it (--critic-load) read its head."""
    from transformers import AutoModelForTokenClassification

    _, hf_dir, ranks = tp2
    hf = AutoModelForTokenClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert hf.config.num_labels == 1 and hf.config.architectures == ["Qwen3ForTokenClassification"]
    batch = make_batch(0)
    for i, values in ranks[0]["after"].items():
        tokens, n = batch.tokens[i], batch.response_lengths[i]
        with torch.no_grad():
            out = hf(torch.tensor([tokens])).logits[0, len(tokens) - n - 1 : len(tokens) - 1, 0]
        torch.testing.assert_close(torch.tensor(values), out, rtol=0, atol=1e-5)
    pp2 = run_ranks(2, megatron_critic_run, tiny_model, 1, 2, None, None, None, hf_dir)[0]
    assert_values_close(ranks[0]["after"], pp2["values"], 1e-5)
    fsdp = run_ranks(1, critic_run, hf_dir)[0]
    assert_values_close(ranks[0]["after"], fsdp["values"], 1e-5)


def test_critic_checkpoints_are_refused_where_they_do_not_belong(tiny_model, tp2, tmp_path):
    """The conversion tools take language models; an actor does not resume from a critic's
    checkpoint, nor a critic from an actor's."""
    from slime.backends.megatron.checkpoint import load_megatron
    from slime.backends.megatron.convert import ConversionError

    save_dir = tp2[0]
    with pytest.raises(ConversionError, match="is a PPO critic's checkpoint"):
        load_megatron(save_dir)
    with pytest.raises(
        Exception, match="a critic's checkpoint is not converted: resume at the layout it was saved"
    ):
        run_ranks(1, megatron_critic_run, tiny_model, 1, 1, None, None, save_dir)  # saved at TP 2
    with pytest.raises(Exception, match=r"holds a critic's checkpoint .*, not an actor's"):
        run_ranks(2, _actor_from, tiny_model, save_dir)
    actor_dir = str(tmp_path / "actor")
    run_ranks(1, _actor_from, tiny_model, None, actor_dir)
    with pytest.raises(Exception, match=r"holds an actor's checkpoint .*, not a critic's"):
        run_ranks(1, megatron_critic_run, tiny_model, 1, 1, None, None, actor_dir)


def _actor_from(rank, world_size, init_method, model, load, save=None):
    from slime.backends import make_train_actor

    actor = make_train_actor(config(model, world_size, 1, load=load), rank, world_size, init_method)
    try:
        actor.init()
        if save:
            actor.save(0, save)
    finally:
        actor.close()


def _with_head(tiny_model: str, out: str, **head: torch.Tensor) -> str:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model, out)
    state = load_file(os.path.join(out, "model.safetensors"))
    save_file({**state, **head}, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_head_of_another_shape_is_refused(tiny_model, tmp_path):
    bad = _with_head(
        tiny_model,
        str(tmp_path / "two_labels"),
        **{"score.weight": torch.zeros(2, 64), "score.bias": torch.zeros(2)},
    )
    with pytest.raises(Exception, match=r"score.weight \(2, 64\), score.bias \(2,\); a critic's head"):
        run_ranks(1, megatron_critic_run, tiny_model, 1, 1, None, None, None, bad)


def test_a_head_without_a_bias_gets_a_fresh_one_on_both_backends(tiny_model, tmp_path):
    """A reward model's `score` has a weight and no bias: both critics take the weight and a zero
    bias, and give the same values."""
    from transformers import AutoConfig

    hidden = AutoConfig.from_pretrained(tiny_model).hidden_size
    weight = 0.02 * torch.randn(1, hidden, generator=torch.Generator().manual_seed(3))
    reward_model = _with_head(tiny_model, str(tmp_path / "rm"), **{"score.weight": weight})
    megatron = run_ranks(1, megatron_critic_run, tiny_model, 1, 1, None, None, None, reward_model)[0]
    fsdp = run_ranks(1, critic_run, reward_model)[0]
    assert_values_close(fsdp["values"], megatron["values"], 1e-5)
    fresh = run_ranks(1, critic_run, tiny_model)[0]
    assert (
        max(abs(a - b) for k in fresh["values"] for a, b in zip(fresh["values"][k], fsdp["values"][k])) > 1e-3
    )


def moe_critic_run(rank, world_size, init_method, model, backend, ep=1):
    """A mixture-of-experts critic with the load-balancing loss, one sample per micro-batch (the
    aux loss balances each micro-batch as a whole: tests/test_megatron_moe_actor.py)."""
    from slime.backends import make_train_actor
    from slime.config.train import MegatronConfig, MoEOptions

    cfg = dataclasses.replace(base_config(model, micro_batch_size=1), moe=MoEOptions(moe_aux_loss_coeff=0.01))
    if backend == "megatron":
        cfg = dataclasses.replace(
            cfg, backend="megatron", megatron=MegatronConfig(expert_model_parallel_size=ep)
        )
    critic = make_train_actor(cfg, rank, world_size, init_method, critic=True)
    critic.init()
    outputs = []
    for r in range(2):
        batch = make_batch(r)
        outputs.append(
            critic.train_values(r, batch, _everyone(critic.compute_values(batch)), fake_returns(batch, r))
        )
    after = _everyone(critic.compute_values(make_batch(0)))
    critic.close()
    return {"outputs": outputs, "after": after}


def test_a_mixture_of_experts_critic_trains_with_the_load_balancing_loss(tiny_moe):
    """--moe-aux-loss-coeff applies to the critic's routers as to the actor's: the FSDP critic on
    one rank and the Megatron critic at EP 2 report the same moe_aux_loss and end equal."""
    fsdp = run_ranks(1, moe_critic_run, tiny_moe, "fsdp")[0]
    ep2 = run_ranks(2, moe_critic_run, tiny_moe, "megatron", 2)
    for a, b in zip(fsdp["outputs"], ep2[0]["outputs"], strict=True):
        for sa, sb in zip(a.steps, b.steps, strict=True):
            assert sa.keys() == sb.keys() and sa["moe_aux_loss"] > 0
            for key in sa:
                assert sb[key] == pytest.approx(sa[key], rel=2e-5, abs=1e-6), key
    assert_values_close(fsdp["after"], ep2[0]["after"], 3e-5)


def head_run(rank, world_size, init_method, sequence_parallel):
    """The value head on a TP group: with sequence parallelism each rank holds half the sequence."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from slime.backends.megatron import cpu_shim
    from slime.backends.megatron.critic import ValueHead

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    cpu_shim.enable()
    g = torch.Generator().manual_seed(0)
    hidden, target = (
        torch.randn(8, 2, 4, generator=g),
        torch.randn(8, 2, 1, generator=g),
    )  # [sequence, batch, ...]
    head = ValueHead(4, sequence_parallel, ps.get_tensor_model_parallel_group())
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, 4, generator=g))
        head.bias.fill_(0.3)
    x = (hidden.chunk(world_size)[rank] if sequence_parallel else hidden).clone().requires_grad_(True)
    values, bias = head(x)
    ((values - target) ** 2).sum().backward()
    from slime.backends.megatron.grads import all_reduce_coalesced

    # as grads.reduce_gradients: each parameter marked sequence_parallel is summed over TP
    marked = [p.grad for p in head.parameters() if getattr(p, "sequence_parallel", False)]
    all_reduce_coalesced(marked, ps.get_tensor_model_parallel_group(), torch.device("cpu"))
    grads = [head.weight.grad, head.bias.grad]
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return {"values": values.detach(), "bias": bias, "grads": grads, "input_grad": x.grad}


def test_the_value_head_gathers_a_sequence_parallel_sequence():
    """With --sequence-parallel (Transformer Engine's spec, GPU only) every TP rank gets the whole
    sequence's values, its own slice's input gradient (not summed over the ranks, which compute
    the same loss), and the head's gradients summed over TP equal the unsplit ones."""
    whole = run_ranks(2, head_run, False)
    split = run_ranks(2, head_run, True)
    for r in range(2):
        assert whole[r]["bias"] is None and whole[r]["values"].shape == (8, 2, 1)
        torch.testing.assert_close(split[r]["values"], whole[0]["values"], rtol=0, atol=0)
        for a, b in zip(split[r]["grads"], whole[0]["grads"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(
        torch.cat([s["input_grad"] for s in split]), whole[0]["input_grad"], rtol=0, atol=0
    )
