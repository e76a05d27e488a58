"""LoRA on the Megatron actor (slime.backends.megatron.lora): the same job trains like the FSDP
actor's PEFT adapters (log-probs, step metrics, the merged weights and the adapters themselves
within 1e-5 in float32) over TP 2, PP 2 and, on Qwen3-MoE's attention, EP 2; step 0 is the base
model bit for bit; --save-hf writes a PEFT adapter directory PEFT loads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")
pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[lora]')")

from tests.dist_helpers import run_ranks

LORA = {"rank": 4, "alpha": 8, "target_modules": ("all-linear",)}


def _run(
    rank,
    world_size,
    init_method,
    model,
    backend,
    tp=1,
    pp=1,
    ep=1,
    save_hf=None,
    lora=True,
    targets=None,
    recompute=False,
    parameters=(),
):
    from slime.backends import make_train_actor
    from slime.config.lora import LoRAConfig
    from slime.config.train import MegatronConfig
    from tests.test_fsdp_actor import base_config, make_batch
    from tests.test_megatron_actor import exported

    torch.set_num_threads(1)
    cfg = base_config(model, micro_batch_size=2)
    if lora:
        settings = {**LORA, "target_modules": LORA["target_modules"] if targets is None else targets}
        settings["target_parameters"] = parameters
        cfg = dataclasses.replace(cfg, lora=LoRAConfig(**settings, save_merged=save_hf is not None))
    if recompute:  # megatron-core's full recompute: each layer runs again in backward (reentrant)
        from slime.config.train import ModelOptions

        cfg = dataclasses.replace(cfg, model=ModelOptions(recompute_granularity="full"))
    if backend == "megatron":
        parallel = MegatronConfig(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
        )
        cfg = dataclasses.replace(cfg, backend="megatron", megatron=parallel)
    actor = make_train_actor(cfg, rank, world_size, init_method)
    actor.init()
    out = {"lp0": actor.compute_log_probs(make_batch(0))}
    if not lora:
        actor.close()
        return out
    out["steps"] = [s for r in range(2) for s in actor.train(r, make_batch(r)).steps]
    out["lp1"] = actor.compute_log_probs(make_batch(7))
    out["weights"] = exported(actor)
    named, config = actor.export_adapter()
    out["adapter"], out["config"] = {n: t.clone() for n, t in named}, config
    if save_hf:
        actor.save_hf(save_hf)
        actor.save(0, save_hf + "-megatron")
    actor.close()
    return out


@pytest.fixture(scope="module")
def fsdp_lora(tiny_model):
    return run_ranks(1, _run, tiny_model, "fsdp")[0]


def _same(fsdp, ranks):
    for key in ("lp0", "lp1"):
        for result in ranks:  # each rank: its data-parallel share, keyed by sample index
            for i, values in result[key].items():
                torch.testing.assert_close(
                    torch.tensor(values), torch.tensor(fsdp[key][i]), rtol=0, atol=1e-5
                )
    for a, b in zip(fsdp["steps"], ranks[0]["steps"], strict=True):
        for metric in ("loss", "pg_loss", "grad_norm", "kl_loss"):
            assert abs(a[metric] - b[metric]) < 1e-5 * max(1.0, abs(a[metric])), (
                metric,
                a[metric],
                b[metric],
            )
    weights = ranks[0]["weights"]
    assert weights.keys() == fsdp["weights"].keys()
    for name, value in fsdp["weights"].items():  # the push: base weights with the adapters merged
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-5, msg=name)
    adapter = ranks[0]["adapter"]
    assert adapter.keys() == fsdp["adapter"].keys() and ranks[0]["config"] == fsdp["config"]
    for name, value in fsdp["adapter"].items():
        torch.testing.assert_close(adapter[name], value, rtol=0, atol=1e-5, msg=name)
    assert any(t.abs().max() > 0 for n, t in adapter.items() if "lora_B" in n)  # the adapters trained


@pytest.mark.parametrize(
    "tp, pp, recompute",
    [(1, 1, False), (2, 1, False), (1, 1, True), pytest.param(1, 2, True, marks=pytest.mark.slow)],
    ids=["tp1", "tp2", "tp1-recompute", "pp2-recompute"],
)
def test_megatron_lora_trains_like_fsdp_lora(fsdp_lora, tiny_model, tp, pp, recompute):
    """With full recompute too: every layer, the first included, trains its adapters."""
    ranks = run_ranks(tp * pp, _run, tiny_model, "megatron", tp, pp, 1, None, True, None, recompute)
    _same(fsdp_lora, ranks)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["glm4", "qwen3_5"])
def test_megatron_lora_on_other_layer_kinds_over_tp2_trains_like_fsdp(tmp_path, arch):
    """GLM-4's gate and up stored as one tensor; Qwen3.5's gated attention (query and gate in one
    q_proj) and gated delta-net projections."""
    from tests.conftest import FAMILY_SIZE, make_model

    path = make_model(str(tmp_path / arch), 0, "--arch", arch, *FAMILY_SIZE)
    _same(run_ranks(1, _run, path, "fsdp")[0], run_ranks(2, _run, path, "megatron", 2))


@pytest.mark.slow
def test_megatron_lora_on_a_moe_models_attention_over_ep2_trains_like_fsdp(tiny_moe):
    """Qwen3-MoE with adapters on its attention; the experts, split over two expert-parallel
    ranks, stay frozen."""
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    fsdp = run_ranks(1, _run, tiny_moe, "fsdp", 1, 1, 1, None, True, attention)[0]
    _same(fsdp, run_ranks(2, _run, tiny_moe, "megatron", 1, 1, 2, None, True, attention))


@pytest.mark.parametrize(
    "arch, targets, parameters",
    [
        ("qwen3_moe", None, ()),
        pytest.param("deepseek_v3", None, (), marks=pytest.mark.slow),
        pytest.param("glm4_moe_lite", None, (), marks=pytest.mark.slow),
        pytest.param(
            "qwen3_next", ("q_proj", "gate_proj", "up_proj", "down_proj", "gate"), (), marks=pytest.mark.slow
        ),
        pytest.param(
            "qwen3_5_moe",
            ("q_proj",),
            ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_megatron_lora_on_the_experts_and_router_over_ep2_trains_like_fsdp(
    tmp_path, arch, targets, parameters
):
    """PEFT's adapters on the fused experts (per expert on megatron-core's local experts, two per
    expert-parallel rank) and on the router (its logits before the top-k): the same job as the
    FSDP actor's, the merged push per expert and the adapters within 1e-5."""
    from tests.conftest import FAMILY_SIZE, make_model

    path = make_model(str(tmp_path / arch), 0, "--arch", arch, *FAMILY_SIZE)
    args = (None, True, targets, False, parameters)
    fsdp = run_ranks(1, _run, path, "fsdp", 1, 1, 1, *args)[0]
    megatron = run_ranks(2, _run, path, "megatron", 1, 1, 2, *args)
    assert any(".mlp.experts.lora_B." in n for n in fsdp["adapter"])
    assert any(".mlp.gate.lora_B." in n for n in fsdp["adapter"]) == (not parameters)
    _same(fsdp, megatron)


@pytest.mark.slow
def test_megatron_lora_on_the_experts_over_pp2_trains_like_fsdp(tmp_path):
    """Each pipeline stage holds its own layers' expert and router adapters."""
    from tests.conftest import FAMILY_SIZE, make_model

    path = make_model(str(tmp_path / "moe"), 0, "--arch", "qwen3_moe", *FAMILY_SIZE)
    _same(run_ranks(1, _run, path, "fsdp")[0], run_ranks(2, _run, path, "megatron", 1, 2))


def test_step_0_is_the_base_model_and_save_hf_writes_what_peft_loads(tiny_model, tmp_path):
    """B starts at zero: the first log-probs are the base model's, bit for bit (at TP 1: with TP
    megatron-core runs frozen weights through another kernel path, an ulp apart). --save-hf writes
    the adapter PEFT loads on --hf-checkpoint (its merge equal to the pushed weights), and
    --lora-save-merged the merged model beside it."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = run_ranks(1, _run, tiny_model, "megatron", 1, 1, 1, None, False)
    lora = run_ranks(1, _run, tiny_model, "megatron", 1, 1, 1, str(tmp_path / "hf"))
    assert lora[0]["lp0"] == base[0]["lp0"]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    merged = PeftModel.from_pretrained(hf, str(tmp_path / "hf")).merge_and_unload()
    state = merged.state_dict()
    written = load_file(tmp_path / "hf" / "merged" / "model.safetensors")
    for name, value in lora[0]["weights"].items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)
        assert torch.equal(written[name], value), name
    # its Megatron checkpoint holds the adapters beside the base model: the conversion tool, which
    # writes a base model, refuses it rather than drop them
    from tests.test_megatron_tools import tool

    ckpt = str(tmp_path / "hf-megatron")
    for args in (
        ["convert_megatron_to_hf", "--hf-checkpoint", tiny_model],
        ["convert_checkpoint", "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2"],
    ):
        r = tool(*args, "--load-dir", ckpt, "--save-dir", str(tmp_path / "out"))
        assert r.returncode == 2 and "a LoRA run's checkpoint" in r.stderr, r.stderr


def test_a_lora_run_starts_from_a_converted_base_checkpoint(tiny_model, tmp_path):
    """--load of convert_hf_to_megatron's release checkpoint: the base from it, the adapters fresh
    (the same first log-probs as from --hf-checkpoint)."""
    from tests.test_megatron_tools import tool

    r = tool("convert_hf_to_megatron", "--hf-checkpoint", tiny_model, "--save-dir", str(tmp_path / "release"))
    assert r.returncode == 0, r.stderr
    from_hf = run_ranks(1, _run, tiny_model, "megatron")[0]
    loaded = run_ranks(1, _load_run, tiny_model, str(tmp_path / "release"))[0]
    assert loaded == from_hf["lp0"]


def _load_run(rank, world_size, init_method, model, load):
    from slime.backends import make_train_actor
    from slime.config.lora import LoRAConfig
    from tests.test_fsdp_actor import base_config, make_batch

    cfg = dataclasses.replace(
        base_config(model, micro_batch_size=2), backend="megatron", load=load, lora=LoRAConfig(**LORA)
    )
    actor = make_train_actor(cfg, rank, world_size, init_method)
    actor.init()
    out = actor.compute_log_probs(make_batch(0))
    actor.close()
    return out


def test_what_megatron_lora_does_not_build_is_refused(tiny_model, tmp_path):
    """Transformer Engine's fused layer-norm linears (the adapters need the normed input) and an
    adapter outside the decoder layers (lm_head): refused by name."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from slime.backends.megatron import lora
    from slime.backends.megatron.convert import Layout
    from slime.config.lora import LoRAConfig
    from slime.utils.errors import UsageError

    config = AutoConfig.from_pretrained(tiny_model)
    mesh = SimpleNamespace(tp=1, pp=1, tp_rank=0, pp_rank=0)
    cfg = SimpleNamespace(lora=LoRAConfig(rank=4, target_modules=("all-linear",)), seed=0)
    with pytest.raises(UsageError, match="--lora-rank with --transformer-impl transformer_engine"):
        lora.build(cfg, Layout.from_hf_config(config, fold_norms=True), config, mesh, torch.nn.Module())
    from tests.conftest import FAMILY_SIZE, make_model

    untied = AutoConfig.from_pretrained(make_model(str(tmp_path / "glm4"), 0, "--arch", "glm4", *FAMILY_SIZE))
    cfg = SimpleNamespace(lora=LoRAConfig(rank=4, target_modules=("q_proj", "lm_head")), seed=0)
    with pytest.raises(UsageError, match="LoRA on lm_head is not built with --train-backend megatron"):
        lora.build(cfg, Layout.from_hf_config(untied), untied, mesh, torch.nn.Module())


def test_what_megatron_does_not_build_of_lora_on_experts_is_refused_by_name():
    """TP above 1 (the factors' gradients are whole on every rank), expert tensor parallelism and
    grouped experts (Transformer Engine's) take no adapters on the experts: refused naming the
    module; a router's adapter has no expert parallelism to refuse; otherwise each EP rank's
    local experts take theirs."""
    from types import SimpleNamespace

    from slime.backends.megatron import lora_experts
    from slime.utils.errors import UsageError

    def mesh(tp=1, ep=1, etp=1, ep_rank=0):
        return SimpleNamespace(tp=tp, ep=ep, etp=etp, ep_rank=ep_rank)

    wrapped = {"model.layers.0.mlp.experts": "model.layers.0.mlp.experts.down_proj"}
    router = {"model.layers.0.mlp.gate": "model.layers.0.mlp.gate.weight"}
    with pytest.raises(UsageError, match=r"mlp\.experts .*--expert-tensor-parallel-size 2 is not built"):
        lora_experts.plan(wrapped, range(2), 4, mesh(etp=2), grouped=False)
    with pytest.raises(UsageError, match="with grouped experts is not built"):
        lora_experts.plan(wrapped, range(2), 4, mesh(), grouped=True)
    with pytest.raises(UsageError, match=r"mlp\.gate .*--tensor-model-parallel-size 2 is not built"):
        lora_experts.plan(router, range(2), 4, mesh(tp=2), grouped=False)
    assert len(lora_experts.plan(router, range(2), 4, mesh(etp=2), grouped=True)) == 1
    targets = lora_experts.plan(wrapped, range(2), 4, mesh(ep=2, ep_rank=1), grouped=False)
    assert [(t.module, t.expert) for t in targets] == [
        ("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2", 2),
        ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2", 3),
    ]
