"""Multi-token prediction (slime.backends.megatron.mtp) from `make_tiny_model --mtp-layers 1`:
the MTP modules convert HF <-> Megatron bitwise through TP/EP splits; megatron-core's MTP block
on converted weights gives the loss of a reference built from transformers' own layers (the
model's hidden states, the next token's embedding, enorm / hnorm / eh_proj, the checkpoint's
extra decoder layer, shared_head.norm and the output head), padded and packed, on one rank and
over TP x EP; the actor trains the modules only with --enable-mtp-training, reports slime's
metrics and pushes without them; the flags are refused where nothing is built."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from tests.conftest import make_model
from tests.dist_helpers import run_ranks
from tests.test_loop_e2e import prompts  # noqa: F401 - a fixture

FAMILIES = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {
        a: make_model(
            str(root / a), 0, "--arch", a, "--hidden-size", "64", "--num-layers", "3", "--mtp-layers", "1"
        )
        for a in FAMILIES
    }


def _hf(path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path), load_file(f"{path}/model.safetensors")


@pytest.mark.parametrize("arch", FAMILIES)
def test_mtp_modules_convert_bitwise_both_ways_through_tp_and_ep(mtp_models, arch):
    from slime.backends.megatron.convert import Layout, hf_to_megatron, megatron_to_hf
    from slime.backends.megatron.layer_map import is_expert
    from slime.backends.megatron.sharding import hf_to_megatron_shard, merge_experts, merge_tp, split_tp

    config, hf = _hf(mtp_models[arch])
    layout = Layout.from_hf_config(config, mtp_layers=1)
    mc = hf_to_megatron(hf, layout, 2)
    mtp = {k for k in mc if k.startswith("mtp.layers.0.")}
    assert {
        "mtp.layers.0.eh_proj.weight",
        "mtp.layers.0.enorm.weight",
        "mtp.layers.0.hnorm.weight",
        "mtp.layers.0.final_layernorm.weight",
        "mtp.layers.0.transformer_layer.mlp.router.weight",
    } <= mtp
    back = megatron_to_hf(mc, layout)
    assert set(back) == set(hf)  # the module's copies of the embedding and the head included
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    # TP 2 x EP 2: the four ranks' shards (read layer by layer) join into the unsharded state
    shards = {
        (t, e): hf_to_megatron_shard(hf, layout, 2, 1, t, 0, 2, 1, e, 0) for t in range(2) for e in range(2)
    }
    dense = merge_tp(
        [{k: v for k, v in shards[(t, 0)].items() if not is_expert(k)} for t in range(2)], layout
    )
    experts = merge_experts({(e, 0): shards[(0, e)] for e in range(2)}, layout)
    assert set(dense) | set(experts) == set(mc)
    for name, t in {**dense, **experts}.items():
        assert torch.equal(t, mc[name]), name
    assert split_tp({"mtp.layers.0.eh_proj.weight": mc["mtp.layers.0.eh_proj.weight"]}, layout, 2)[1][
        "mtp.layers.0.eh_proj.weight"
    ].shape == (32, 128)  # a column-parallel linear: rows split


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp_loss(path: str, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """The depth-1 MTP loss of one sequence `ids` ([1, s]) from transformers' layers: at position
    i, eh_proj([enorm(embed(token i+1)); hnorm(h_i)]) through the checkpoint's layer L, then
    shared_head.norm and the head; cross entropy against token i+2, weighted by `mask` (token
    aligned) at i+2, averaged over its weight."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config, hf = _hf(path)
    L, eps = config.num_hidden_layers, config.rms_norm_eps
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    deeper_config = AutoConfig.from_pretrained(path)
    deeper_config.num_hidden_layers = L + 1
    if getattr(deeper_config, "mlp_layer_types", None):
        deeper_config.mlp_layer_types = [*deeper_config.mlp_layer_types, "sparse"]
    deeper = AutoModelForCausalLM.from_pretrained(
        path, config=deeper_config, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    mtp_layer = deeper.model.layers[L]
    p = f"model.layers.{L}."
    s = ids.shape[1]
    with torch.no_grad():
        h = model.model(ids).last_hidden_state
        nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        e = model.model.embed_tokens(nxt)
        x = torch.cat([_rms(e, hf[p + "enorm.weight"], eps), _rms(h, hf[p + "hnorm.weight"], eps)], dim=-1)
        x = x @ hf[p + "eh_proj.weight"].T
        pos = torch.arange(s).unsqueeze(0)
        y = mtp_layer(
            x, attention_mask=None, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos)
        )
        y = y[0] if isinstance(y, tuple) else y
        logits = model.lm_head(_rms(y, hf[p + "shared_head.norm.weight"], eps))[0]
    targets, weights = ids[0, 2:], mask[0, 2:]
    ce = -torch.log_softmax(logits[: s - 2], dim=-1).gather(1, targets[:, None])[:, 0]
    return float((ce * weights).sum() / weights.sum())


RESPONSES, MASKS = [5, 4], [[1, 1, 0, 1, 1], [1, 1, 1, 1]]
"""Two samples' response lengths and loss masks (one token left out of the loss)."""


def mtp_samples(vocab: int) -> list[list[int]]:
    """The two samples' tokens (9 and 7), seeded."""
    torch.manual_seed(1)
    return [torch.randint(3, vocab, (n,)).tolist() for n in (9, 7)]


def reference_mean(path: str, tokens: list[list[int]]) -> float:
    """The depth-1 MTP loss of the samples as one micro-batch: the token mean over their weighted
    targets, each sample's from reference_mtp_loss."""
    from slime.backends.megatron.mtp import token_loss_mask
    from slime.backends.micro_batch import make_micro_batch

    parts = []
    for i, sample in enumerate(tokens):
        mask = token_loss_mask(make_micro_batch([i], tokens, RESPONSES, MASKS, torch.device("cpu")))
        weight = float(mask[0, 2:].sum())
        parts.append((reference_mtp_loss(path, torch.tensor([sample]), mask) * weight, weight))
    return sum(s for s, _ in parts) / sum(w for _, w in parts)


def mtp_loss_of(model: Any, tokens: list[list[int]], packed: bool, device: str, cp: Any = None) -> float:
    """The model's depth-1 MTP metric on the samples as one micro-batch (packed or padded rows;
    `cp`: this CP rank's share), run as the actor runs a micro-batch
    (context_parallel.run_micro_batch)."""
    from slime.backends.megatron import mtp
    from slime.backends.megatron.context_parallel import run_micro_batch
    from slime.backends.micro_batch import make_micro_batch

    mb = make_micro_batch([0, 1], tokens, RESPONSES, MASKS, torch.device(device), packed)
    objective = mtp.objective(model)
    objective.begin(mtp.target_counts([mb], 1), 0.2)
    with torch.no_grad():
        run_micro_batch(
            model, mb, {"labels": mb.input_ids, "loss_mask": mtp.token_loss_mask(mb)}, False, False, cp
        )
    return float(objective.end()["mtp_1_loss"])


def _mtp_forward(rank, world_size, init_method, path, tp, ep, packed, cp=1):
    """megatron-core's depth-1 MTP loss (the objective's metric) of two samples in one micro-batch
    (with `cp` > 1 split over the CP ranks, the metric summed over them)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from slime.backends.megatron import cpu_shim, mtp
    from slime.backends.megatron.convert import Layout
    from slime.backends.megatron.export import Mesh
    from slime.backends.megatron.model import build_gpt_model, transformer_config
    from slime.backends.megatron.sharding import hf_to_megatron_shard

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        context_parallel_size=cp,
    )
    cpu_shim.enable()
    cpu_shim.seed(0, ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank())
    config, hf = _hf(path)
    layout = Layout.from_hf_config(config, mtp_layers=1)
    mc = transformer_config(
        layout,
        config,
        cpu_init=True,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        context_parallel_size=cp,
    )
    model = build_gpt_model(layout, config, mc, tp)
    shard = hf_to_megatron_shard(
        hf,
        layout,
        tp,
        1,
        ps.get_tensor_model_parallel_rank(),
        0,
        ep,
        1,
        ps.get_expert_model_parallel_rank(),
        0,
    )
    missing = model.load_state_dict(shard, strict=False).missing_keys
    assert not [k for k in missing if not k.endswith("._extra_state")], missing
    group = ps.get_context_parallel_group() if cp > 1 else None
    mtp.attach(model, layout, Mesh.from_parallel_state(), train=True, cp_group=group)
    model.eval()
    tokens = mtp_samples(config.vocab_size)
    loss = mtp_loss_of(
        model, tokens, packed, "cpu", (cp, ps.get_context_parallel_rank(), group) if group else None
    )
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return {"mtp_1_loss": loss, "tokens": tokens}


@pytest.mark.parametrize(
    "arch, tp, ep, packed, cp",
    [
        ("deepseek_v3", 1, 1, True, 1),
        ("glm4_moe", 1, 1, False, 2),
        pytest.param("glm4_moe_lite", 1, 1, False, 1, marks=pytest.mark.slow),
        pytest.param("glm4_moe", 2, 2, True, 1, marks=pytest.mark.slow),
        pytest.param("deepseek_v3", 1, 2, True, 2, marks=pytest.mark.slow),
    ],
)
def test_megatron_cores_mtp_loss_is_a_reference_built_from_hf_layers(mtp_models, arch, tp, ep, packed, cp):
    """Also split over CP ranks: megatron-core rolls the targets across the ranks' chunks."""
    path = mtp_models[arch]
    out = run_ranks(max(tp, ep) * cp, _mtp_forward, path, tp, ep, packed, cp)[0]
    want = reference_mean(path, out["tokens"])
    assert out["mtp_1_loss"] == pytest.approx(want, rel=1e-5, abs=1e-6), (out["mtp_1_loss"], want)


def test_token_loss_mask_puts_each_response_tokens_mask_on_the_token():
    from slime.backends.megatron.mtp import token_loss_mask
    from slime.backends.micro_batch import make_micro_batch

    tokens = [[1, 2, 3, 4, 5], [6, 7, 8]]
    mb = make_micro_batch([0, 1], tokens, [3, 1], [[1, 0, 1], [1]], torch.device("cpu"))
    assert token_loss_mask(mb).tolist() == [[0, 0, 1, 0, 1], [0, 0, 1, 0, 0]]
    packed = make_micro_batch([0, 1], tokens, [3, 1], [[1, 0, 1], [1]], torch.device("cpu"), packed=True)
    assert token_loss_mask(packed).tolist() == [[0, 0, 1, 0, 1, 0, 0, 1]]


def test_the_tiny_checkpoint_has_the_mtp_modules_as_released_ones_store_them(mtp_models):
    from safetensors import safe_open

    config = json.load(open(f"{mtp_models['deepseek_v3']}/config.json"))
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 3
    with safe_open(f"{mtp_models['deepseek_v3']}/model.safetensors", "pt") as f:
        names = set(f.keys())
        assert torch.equal(
            f.get_tensor("model.layers.3.embed_tokens.weight"), f.get_tensor("model.embed_tokens.weight")
        )
    assert {
        "model.layers.3.eh_proj.weight",
        "model.layers.3.shared_head.head.weight",
        "model.layers.3.mlp.experts.0.gate_proj.weight",
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
    } <= names


def _actor_run(
    rank,
    world_size,
    init_method,
    path,
    train_mtp,
    ep=1,
    device="cpu",
    factor=0.2,
    ref_load=None,
    bf16=False,
    clip=None,
    cp=1,
    pp=1,
    recompute=False,
):
    """Two rollouts of the Megatron actor with the MTP modules built (trained or kept; with PP, on
    the last stage: the returned tensors are the rank's own)."""
    import dataclasses

    from slime.backends import make_train_actor
    from tests.test_fsdp_actor import make_batch
    from tests.test_megatron_actor import config, exported

    cfg = config(path, device=device)
    megatron = dataclasses.replace(
        cfg.megatron,
        mtp_num_layers=1,
        enable_mtp_training=train_mtp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        mtp_loss_scaling_factor=factor,
        bf16=bf16,
        context_parallel_size=cp,
        pipeline_model_parallel_size=pp,
        # uneven stages, as slime's GLM-4.7-Flash script has them
        decoder_last_pipeline_num_layers=1 if pp > 1 else None,
    )
    cfg = dataclasses.replace(cfg, megatron=megatron, ref_load=ref_load)
    if recompute:  # megatron-core's full recompute of the decoder's layers
        from slime.config.train import ModelOptions

        cfg = dataclasses.replace(cfg, model=ModelOptions(recompute_granularity="full"))
    if clip is not None:  # the gradient norm counts every parameter: clipping ties the MTP grads to the rest
        cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, clip_grad=clip))
    actor = make_train_actor(cfg, rank, world_size, init_method)
    actor.init()
    calls = {"log_probs": 0, "train": 0}  # the MTP block's forwards in each kind of pass
    phase = ["log_probs"]
    if hasattr(actor.backend.model, "mtp"):  # (the last stage's)
        actor.backend.model.mtp.register_forward_hook(
            lambda *_: calls.__setitem__(phase[0], calls[phase[0]] + 1)
        )
    before = {k: v.cpu().clone() for k, v in actor.backend.model_state().items() if k.startswith("mtp.")}
    lp = actor.compute_log_probs(make_batch(0))
    phase[0] = "train"  # (a train call runs its own log-prob passes too: counted here)
    outputs = [actor.train(r, make_batch(r)) for r in range(2)]
    weights = {
        k: v.float().cpu().clone() for k, v in actor.backend.model_state().items() if not k.startswith("mtp.")
    }
    after = {k: v.cpu().clone() for k, v in actor.backend.model_state().items() if k.startswith("mtp.")}
    pushed_tensors = exported(actor)
    pushed = set(pushed_tensors)
    shapes = set(actor.weight_shapes())
    from slime.backends.megatron.export import export_hf_tensors

    local = {k: v.detach() for k, v in actor.backend.model_state().items()}
    saved = dict(export_hf_tensors(local, actor.backend.layout, actor.backend.mesh, with_mtp=True))
    actor.close()
    return {
        "lp": lp,
        "outputs": [o.steps for o in outputs],
        "before": before,
        "after": after,
        "pushed": pushed,
        "shapes": shapes,
        "saved": set(saved),
        "calls": calls,
        "weights": weights,
        "saved_tensors": saved,
        "pushed_tensors": pushed_tensors,
    }


@pytest.mark.slow
def test_the_actor_trains_the_mtp_modules_only_when_asked_and_pushes_without_them(mtp_models):
    path = mtp_models["deepseek_v3"]
    kept = run_ranks(1, _actor_run, path, False)[0]
    trained = run_ranks(1, _actor_run, path, True)[0]
    plain_config, hf = _hf(path)
    # a log-prob pass never runs the modules; training runs them only with --enable-mtp-training
    assert kept["calls"]["log_probs"] == trained["calls"]["log_probs"] == 0
    assert kept["calls"]["train"] == 0 < trained["calls"]["train"]
    # kept: not a bit moved, no MTP metrics; trained: every module tensor the loss reaches moved
    assert all(torch.equal(kept["before"][k], kept["after"][k]) for k in kept["before"])
    moved = [k for k in trained["before"] if not torch.equal(trained["before"][k], trained["after"][k])]
    assert "mtp.layers.0.eh_proj.weight" in moved and "mtp.layers.0.enorm.weight" in moved
    assert not any("mtp_loss" in s for o in kept["outputs"] for s in o)
    steps = [s for o in trained["outputs"] for s in o]
    losses = [s["mtp_loss"] for s in steps if "mtp_loss" in s]
    assert losses and all(0 < x < 10 for x in losses), steps
    assert all(s["mtp_loss"] == pytest.approx(s["mtp_1_loss"]) for s in steps if "mtp_loss" in s)
    # the push (and the engine's shapes) leave the modules out; the HF export has them, as the checkpoint
    mtp_hf = {k for k in hf if k.startswith(f"model.layers.{plain_config.num_hidden_layers}.")}
    for run in (kept, trained):
        assert run["pushed"] == run["shapes"] == set(hf) - mtp_hf
        assert run["saved"] == set(hf)


@pytest.mark.slow
def test_mtp_training_on_two_expert_parallel_ranks_is_like_one(mtp_models):
    path = mtp_models["glm4_moe"]
    one = run_ranks(1, _actor_run, path, True)[0]
    two = run_ranks(2, _actor_run, path, True, 2)
    for k, v in one["after"].items():
        torch.testing.assert_close(
            two[0]["after"][k], v, rtol=1e-4, atol=1e-5
        ) if "experts" not in k else None
    steps_one = [s for o in one["outputs"] for s in o]
    steps_two = [s for o in two[0]["outputs"] for s in o]
    for a, b in zip(steps_one, steps_two, strict=True):
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("cp, pp", [(2, 1), (1, 2), (2, 2)])
def test_mtp_training_over_context_parallel_and_pipeline_ranks_is_like_one(mtp_models, cp, pp):
    """CP: each rank's MTP loss covers its own tokens (the targets rolled across the ranks'
    chunks), the gradients and the metric summed over CP. PP: the modules on the last stage, with
    megatron-core's copy of the embedding there, kept equal to the first stage's (its gradient is
    the first stage's). Either way the step metrics, the MTP modules and the saved model (MTP
    modules included) are those of one rank."""
    path = mtp_models["deepseek_v3"]
    one = run_ranks(1, _actor_run, path, True)[0]
    ranks = run_ranks(cp * pp, _actor_run, path, True, 1, "cpu", 0.2, None, False, None, cp, pp)
    last = ranks[-1]  # (a last-stage rank: it holds the MTP modules and the step metrics)
    for k, v in one["after"].items():
        torch.testing.assert_close(last["after"][k], v, rtol=1e-4, atol=1e-5)
    steps_one = [s for o in one["outputs"] for s in o]
    steps_many = [s for o in last["outputs"] for s in o]
    for a, b in zip(steps_one, steps_many, strict=True):
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert ranks[0]["saved_tensors"].keys() == one["saved_tensors"].keys()
    for k, v in one["saved_tensors"].items():
        torch.testing.assert_close(ranks[0]["saved_tensors"][k], v, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_mtp_training_under_full_recompute_is_like_without(mtp_models):
    """The decoder recomputed in backward (slime's scripts give --recompute-granularity full), the
    MTP layers not (megatron-core 0.16's reentrant checkpoint of their detached inputs gives their
    parameters no gradient: with it, none of their tensors moved): the same steps as without."""
    path = mtp_models["deepseek_v3"]
    plain = run_ranks(1, _actor_run, path, True)[0]
    recomputed = run_ranks(1, _actor_run, path, True, 1, "cpu", 0.2, None, False, None, 1, 1, True)[0]
    for k, v in plain["after"].items():
        torch.testing.assert_close(recomputed["after"][k], v, rtol=1e-5, atol=1e-6)
    for a, b in zip(
        [s for o in plain["outputs"] for s in o], [s for o in recomputed["outputs"] for s in o], strict=True
    ):
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], rel=1e-6)


def test_the_mtp_flags_are_refused_where_nothing_is_built(mtp_models, tiny_model, tmp_path, capsys):
    from slime.ray.cli import parse_args
    from tests.test_flag_surface import base, error

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    model = mtp_models["deepseek_v3"]
    cfg = parse_args(
        base(
            model,
            str(data),
            "--train-backend",
            "megatron",
            "--mtp-num-layers",
            "1",
            "--enable-mtp-training",
            "--mtp-loss-scaling-factor",
            "0.1",
        )
    )
    m = cfg.train.megatron
    assert (m.mtp_num_layers, m.enable_mtp_training, m.mtp_loss_scaling_factor) == (1, True, 0.1)
    cases = [
        (
            ["--train-backend", "fsdp", "--mtp-num-layers", "1"],
            "multi-token prediction modules are built by the Megatron",
        ),
        (["--train-backend", "megatron", "--enable-mtp-training"], "give --mtp-num-layers N"),
        (["--train-backend", "megatron", "--mtp-num-layers", "2"], "num_nextn_predict_layers"),
    ]
    for extra, message in cases:
        assert message in error(capsys, base(model, str(data), *extra)), extra
    # a checkpoint without MTP modules
    assert "this model has none" in error(
        capsys, base(tiny_model, str(data), "--train-backend", "megatron", "--mtp-num-layers", "1")
    )


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize(
    "layout",
    [
        ["--expert-model-parallel-size", "2"],
        # slime's GLM-4.7-Flash layout in small: uneven pipeline stages and CP, MTP on the last stage
        [
            "--pipeline-model-parallel-size",
            "2",
            "--decoder-last-pipeline-num-layers",
            "1",
            "--context-parallel-size",
            "2",
            "--actor-num-gpus-per-node",
            "4",
        ],
    ],
    ids=["ep2", "pp2-cp2"],
)
def test_a_megatron_grpo_job_trains_the_mtp_modules_and_pushes_without_them(
    mtp_models,
    prompts,
    tmp_path,
    layout,
):
    from safetensors import safe_open

    from tests.test_loop_e2e import run_job

    model = mtp_models["deepseek_v3"]
    proc = run_job(
        "train.py",
        model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--check-precision",
        "--check-weight-sync",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.01",
        "--actor-num-gpus-per-node",
        "2",
        "--train-backend",
        "megatron",
        "--mtp-num-layers",
        "1",
        "--enable-mtp-training",
        "--save-hf",
        str(tmp_path / "hf"),
        *layout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    checks = json.loads((tmp_path / "logs" / "precision.json").read_text())["checks"]
    assert checks and all(c["ok"] is not False for c in checks), checks
    with safe_open(f"{model}/model.safetensors", "pt") as f:
        names = set(f.keys())
    mtp = {n for n in names if n.startswith("model.layers.3.")}
    synced = [int(n) for n in re.findall(r"--check-weight-sync: (\d+) tensors match on every engine", out)]
    assert len(synced) >= 2 and set(synced) == {len(names - mtp)}, synced
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert any("train/mtp_loss" in r for r in records), records[-1]
    saved = list((tmp_path / "hf").glob("**/model*.safetensors"))
    assert saved
    with safe_open(str(saved[0]), "pt") as f:
        assert mtp <= set(f.keys())


@pytest.mark.slow
def test_the_mtp_loss_trains_the_mtp_modules_only(mtp_models):
    """As slime's megatron-core: the block reads the hidden states, the embedding and the head
    detached, so the policy's weights end the same with the MTP loss weighted or not at all
    (without gradient clipping, whose norm counts the MTP modules' gradients too, as slime's does)."""
    path = mtp_models["deepseek_v3"]
    weighted = run_ranks(1, _actor_run, path, True, 1, "cpu", 0.2, None, False, 0.0)[0]
    unweighted = run_ranks(1, _actor_run, path, True, 1, "cpu", 0.0, None, False, 0.0)[0]
    for name, value in weighted["weights"].items():
        assert torch.equal(value, unweighted["weights"][name]), name
    differ = [k for k in weighted["after"] if not torch.equal(weighted["after"][k], unweighted["after"][k])]
    assert "mtp.layers.0.eh_proj.weight" in differ


@pytest.mark.slow
def test_a_reference_without_mtp_modules_and_bf16_with_them_kept(mtp_models, tmp_path):
    """--ref-load of a checkpoint without MTP tensors (reference passes never run them): the
    step-0 KL is 0 against the same weights; --bf16 with the modules kept (frozen) starts and trains."""
    path = mtp_models["deepseek_v3"]
    plain = make_model(
        str(tmp_path / "plain"), 0, "--arch", "deepseek_v3", "--hidden-size", "64", "--num-layers", "3"
    )
    out = run_ranks(1, _actor_run, path, True, 1, "cpu", 0.2, plain)[0]
    assert out["outputs"][0][0]["kl_loss"] == 0.0
    kept = run_ranks(1, _actor_run, path, False, 1, "cpu", 0.2, None, True)[0]
    assert all(torch.equal(kept["before"][k], kept["after"][k]) for k in kept["before"])
