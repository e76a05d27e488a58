"""The model families beyond Qwen2/Qwen3 (slime.utils.model_families), each from
`make_tiny_model --arch`: trained by the FSDP actor on two ranks like on one with a step-0 KL of
exactly 0, refused by name by the Megatron backend, and listed in docs/models.md as the registry
says (the engine on each family: tests/test_engine_families.py)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from slime.tools.tiny_families import NEW_FAMILIES
from slime.utils.model_families import FAMILIES, models_table
from tests.dist_helpers import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_tiny_family_has_its_real_config_fields(family_models):
    import json

    def config(arch):
        with open(os.path.join(family_models[arch], "config.json")) as f:
            return json.load(f)

    glm4 = config("glm4")
    assert glm4["rope_parameters"]["partial_rotary_factor"] == 0.5 and glm4["attention_bias"]
    ds = config("deepseek_v3")
    assert ds["kv_lora_rank"] and ds["q_lora_rank"] and ds["rope_interleave"] and ds["n_group"] == 2
    assert ds["first_k_dense_replace"] == 1 and ds["n_shared_experts"] == 1
    lite = config("glm4_moe_lite")  # GLM-4.7-Flash: values wider than the keys' non-rotary part
    assert lite["mlp_layer_types"] == ["dense", "sparse"] and lite["rope_interleave"]
    assert lite["v_head_dim"] > lite["qk_nope_head_dim"] and lite["routed_scaling_factor"] == 1.8
    for arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        assert config(arch)["layer_types"] == ["linear_attention", "full_attention"], arch
    by_type = {f.arch: f for f in FAMILIES.values()}
    for arch in NEW_FAMILIES:  # the registry knows each by the model_type the checkpoint says
        assert FAMILIES[config(arch)["model_type"]] is by_type[arch]


def _train(rank, world_size, init_method, model):
    from slime.backends.fsdp.actor import FSDPTrainActor
    from tests.test_fsdp_actor import base_config, make_batch

    cfg = base_config(model, use_dynamic_batch_size=True, max_tokens_per_gpu=48)
    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    actor.init()
    log_probs = actor.compute_log_probs(make_batch(0))
    before = {n: p.full_tensor().detach().clone() for n, p in actor.backend.model.named_parameters()}
    outputs = [actor.train(r, make_batch(r)) for r in range(2)]
    after = {n: p.full_tensor().detach().clone() for n, p in actor.backend.model.named_parameters()}
    exported = [n for bucket in actor.export_weights(bucket_bytes=200_000) for n, _ in bucket]
    result = dict(
        outputs=outputs,
        before=before,
        after=after,
        exported=exported,
        packed=actor.backend.packs_sequences,
        log_probs=log_probs,
    )
    actor.close()
    return result


# In the default run: a hybrid (linear attention), multi-latent attention with grouped routing,
# and GLM-4.5's sigmoid experts; the others (their layers covered by these) in the slow run.
DEFAULT_FSDP = ("qwen3_next", "deepseek_v3")  # (glm4_moe routes as deepseek_v3: slow)


@pytest.mark.parametrize(
    "arch", [a if a in DEFAULT_FSDP else pytest.param(a, marks=pytest.mark.slow) for a in NEW_FAMILIES]
)
def test_fsdp_trains_each_family_on_two_ranks_like_one(family_models, arch):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tests.test_engine_server import teacher_forced_logprobs
    from tests.test_fsdp_actor import make_batch

    path = family_models[arch]
    one = run_ranks(1, _train, path)[0]
    two = run_ranks(2, _train, path)
    # The sharded model is the checkpoint's (buffers too): its log-probs are Hugging Face's.
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = make_batch(0)
    for i, (tokens, n) in enumerate(zip(batch.tokens, batch.response_lengths)):
        ref = teacher_forced_logprobs(hf, tokens[:-n], tokens[-n:], 1.0)
        assert (torch.tensor(one["log_probs"][i]) - ref).abs().max() < 1e-5, i
    first = one["outputs"][0].steps[0]
    assert first["ppo_kl"] == 0.0 and first["kl_loss"] == 0.0, first
    assert all(math.isfinite(v) for out in one["outputs"] for s in out.steps for v in s.values())
    steps = [s for o in one["outputs"] for s in o.steps]
    for rank in two:  # pg_loss is a sum of near-cancelling terms (centred advantages): absolute 1e-6
        for a, b in zip(steps, [s for o in rank["outputs"] for s in o.steps], strict=True):
            bad = {m: (a[m], b[m]) for m in a if not math.isclose(a[m], b[m], rel_tol=1e-5, abs_tol=1e-6)}
            assert not bad, bad
    moved = [n for n in one["after"] if not torch.equal(one["after"][n], one["before"][n])]
    assert moved, "no parameter moved"
    for name, value in one["after"].items():
        torch.testing.assert_close(two[0]["after"][name], value, rtol=0, atol=2e-5)
    # The push speaks the checkpoint's names: every tensor of model.safetensors, nothing else.
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert sorted(one["exported"]) == sorted(f.keys())
    assert one["packed"] == FAMILIES[_model_type(path)].packs


def _model_type(path: str) -> str:
    import json

    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["model_type"]


def test_megatron_builds_each_family_and_names_what_it_refuses(family_models):
    """Every new family converts (tests/test_megatron_families.py checks the numbers); of Qwen3.5's
    released vision-language checkpoint, the text model under model.language_model; Qwen3-VL is
    refused by name, pointing at FSDP."""
    import transformers
    from transformers import AutoConfig

    from slime.backends.megatron.convert import ConversionError, Layout

    for arch in NEW_FAMILIES:
        assert Layout.from_hf_config(AutoConfig.from_pretrained(family_models[arch])).num_layers == 2
    text = AutoConfig.from_pretrained(family_models["qwen3_5"])
    released = transformers.Qwen3_5Config(text_config=text.to_dict())
    assert Layout.from_hf_config(released) == Layout.from_hf_config(text)
    qwen3_vl = transformers.Qwen3VLConfig()
    with pytest.raises(
        ConversionError, match=r"'qwen3_vl': vision-language models train with --train-backend fsdp"
    ):
        Layout.from_hf_config(qwen3_vl)


def test_docs_models_table_is_the_registry():
    with open(os.path.join(ROOT, "docs", "models.md")) as f:
        assert models_table() in f.read(), "run: python -m slime.utils.model_families --write"


def test_what_a_family_lacks_is_refused_by_name(family_models, tmp_path, capsys):
    """PPO's FSDP critic for a model transformers has no token classifier of, and the adapter push
    of multi-latent attention's kv_b_proj to the torch engine (its absorbed form takes no
    adapter): exit 2 naming them, before anything starts."""
    from tests.test_flag_surface import base, error

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    lora = ["--lora-rank", "4", "--target-modules", "all-linear", "--lora-push", "adapter"]
    err = error(capsys, base(family_models["deepseek_v3"], str(prompts), *lora))
    assert "multi-latent attention): the torch engine computes kv_b_proj in the absorbed form" in err
    from slime.ray.cli import parse_args

    fine = base(family_models["deepseek_v3"], str(prompts), *lora, "--exclude-modules", "self_attn.kv_b_proj")
    assert parse_args(fine).train.lora.exclude_modules == ("self_attn.kv_b_proj",)
    capsys.readouterr()
    # PPO's critic with FSDP is transformers' token classifier, which Qwen3.5's text model lacks
    err = error(capsys, base(family_models["qwen3_5"], str(prompts), "--advantage-estimator", "ppo"))
    assert "'qwen3_5_text': a value model (PPO's critic) of this model is not built with FSDP" in err


def _slime_model_args(arch: str, c: dict) -> list[str]:
    """The MODEL_ARGS a slime model script (scripts/models/*.sh) writes for the family, with the
    tiny checkpoint's sizes: the flags spelled as slime's scripts for GLM-4-9B, GLM-4.5,
    DeepSeek-V3, Qwen3-Next and Qwen3.5 spell them."""
    common = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--norm-epsilon",
        "1e-6",
        "--vocab-size",
        "101",
        "--untie-embeddings-and-output-weights",
        "--position-embedding-type",
        "rope",
        "--no-rope-fusion",
    ]
    gqa = ["--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16"]
    if arch == "glm4":
        return [
            *common,
            *gqa,
            "--ffn-hidden-size",
            str(c["intermediate_size"]),
            "--disable-bias-linear",
            "--add-qkv-bias",
            "--post-self-attn-layernorm",
            "--post-mlp-layernorm",
            "--rotary-interleaved",
            "--rotary-percent",
            "0.5",
            "--spec",
            "slime_plugins.models.glm4",
            "get_glm_spec",
        ]
    moe = [
        "--moe-ffn-hidden-size",
        "32",
        "--moe-router-topk",
        "2",
        "--num-experts",
        "4",
        "--moe-aux-loss-coeff",
        "0",
        "--moe-grouped-gemm",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--moe-router-dtype",
        "fp32",
    ]
    if arch == "glm4_moe":
        return [
            *common,
            *gqa,
            *moe,
            "--ffn-hidden-size",
            str(c["intermediate_size"]),
            "--disable-bias-linear",
            "--add-qkv-bias",
            "--qk-layernorm",
            "--rotary-percent",
            "0.5",
            "--moe-layer-freq",
            "[0]*1+[1]*1",
            "--moe-shared-expert-intermediate-size",
            "32",
            "--moe-router-pre-softmax",
            "--moe-router-score-function",
            "sigmoid",
            "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate",
            "0",
            "--moe-router-load-balancing-type",
            "seq_aux_loss",
            "--moe-router-topk-scaling-factor",
            "2.5",
        ]
    if arch == "deepseek_v3":
        return [
            *common,
            *moe,
            "--ffn-hidden-size",
            str(c["intermediate_size"]),
            "--disable-bias-linear",
            "--kv-channels",
            "16",
            "--multi-latent-attention",
            "--q-lora-rank",
            "32",
            "--kv-lora-rank",
            "16",
            "--qk-head-dim",
            "16",
            "--qk-pos-emb-head-dim",
            "8",
            "--v-head-dim",
            "16",
            "--qk-layernorm",
            "--rotary-base",
            "10000",
            "--mscale",
            "1.0",
            "--mscale-all-dim",
            "1.0",
            "--moe-layer-freq",
            "[0]*1+[1]*1",
            "--moe-shared-expert-intermediate-size",
            "32",
            "--moe-router-pre-softmax",
            "--moe-router-score-function",
            "sigmoid",
            "--moe-router-enable-expert-bias",
            "--moe-router-load-balancing-type",
            "seq_aux_loss",
            "--moe-router-bias-update-rate",
            "0",
            "--moe-router-group-topk",
            "1",
            "--moe-router-num-groups",
            "2",
            "--moe-router-topk-scaling-factor",
            "2.5",
        ]
    if arch == "glm4_moe_lite":  # as slime's glm4.7-30B-A3B script spells them (--add-qkv-bias included)
        return [
            *common,
            *moe,
            "--ffn-hidden-size",
            str(c["intermediate_size"]),
            "--disable-bias-linear",
            "--add-qkv-bias",
            "--kv-channels",
            "16",
            "--multi-latent-attention",
            "--q-lora-rank",
            "32",
            "--kv-lora-rank",
            "16",
            "--qk-head-dim",
            "16",
            "--qk-pos-emb-head-dim",
            "8",
            "--v-head-dim",
            str(c["v_head_dim"]),
            "--qk-layernorm",
            "--rotary-base",
            "10000",
            "--moe-layer-freq",
            "[0]*1+[1]*1",
            "--moe-shared-expert-intermediate-size",
            "32",
            "--moe-router-pre-softmax",
            "--moe-router-score-function",
            "sigmoid",
            "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate",
            "0",
            "--moe-router-load-balancing-type",
            "seq_aux_loss",
            "--moe-router-topk-scaling-factor",
            "1.8",
        ]
    hybrid = [
        *common,
        *gqa,
        "--ffn-hidden-size",
        str(c["intermediate_size"]),
        "--disable-bias-linear",
        "--qk-layernorm",
        "--use-gated-attention",
        "--apply-layernorm-1p",
        "--rotary-percent",
        "0.25",
        "--attention-output-gate",
        "--spec",
        *SLIME_SPECS[arch],
    ]
    if arch == "qwen3_5":
        return hybrid
    return [
        *hybrid,
        *moe,
        "--moe-shared-expert-intermediate-size",
        "32",
        "--moe-router-score-function",
        "softmax",
        "--moe-shared-expert-gate",
    ]


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_slimes_model_flags_for_each_family_are_checked_against_the_checkpoint(
    family_models, tmp_path, capsys, arch
):
    """The flags of slime's model script describe the checkpoint (each compared with config.json);
    one flag left out is named with the config key; Megatron checks them too (slime's layer specs
    for these families are accepted: the Megatron backend builds their layers)."""
    import json

    from slime.ray.cli import parse_args
    from tests.test_flag_surface import base, error

    path = family_models[arch]
    with open(os.path.join(path, "config.json")) as f:
        args = _slime_model_args(arch, json.load(f))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    cfg = parse_args(base(path, str(prompts), *args))
    noted = [line for line in cfg.args.resolution if line.startswith("no effect in this backend (fsdp)")]
    # slime's spec of the family describes the model both backends build: accepted, not listed
    assert not noted or "--spec" not in noted[0]
    flag = {
        "glm4": "--rotary-interleaved",
        "glm4_moe": "--moe-router-enable-expert-bias",
        "deepseek_v3": "--multi-latent-attention",
        "glm4_moe_lite": "--multi-latent-attention",
    }.get(arch, "--apply-layernorm-1p")
    left_out = [a for a in args if a != flag]
    for backend in ("fsdp", "megatron"):
        err = error(capsys, base(path, str(prompts), *left_out, "--train-backend", backend))
        assert f"no {flag} (Megatron-LM's default: off) disagrees with --hf-checkpoint {path}" in err
    # the whole script parses with Megatron too
    assert (
        parse_args(base(path, str(prompts), *args, "--train-backend", "megatron")).train.backend == "megatron"
    )
    # slime's spec of another family is named
    other = ["--spec", *(SLIME_SPECS["qwen3_5"] if arch == "qwen3_next" else SLIME_SPECS["qwen3_next"])]
    own = [a for a in args if a != "--spec" and a not in SLIME_SPECS.get(arch, [])]
    err = error(capsys, base(path, str(prompts), *own, *other))
    assert f"--spec {other[1]} {other[2]} is slime's layer spec for model_type" in err, err


SLIME_SPECS = {
    "glm4": ["slime_plugins.models.glm4", "get_glm_spec"],
    "qwen3_next": ["slime_plugins.models.qwen3_next", "get_qwen3_next_spec"],
    "qwen3_5": ["slime_plugins.models.qwen3_5", "get_qwen3_5_spec"],
    "qwen3_5_moe": ["slime_plugins.models.qwen3_5", "get_qwen3_5_spec"],
}


@pytest.mark.parametrize(
    "arch",
    [
        a if a == "glm4" else pytest.param(a, marks=pytest.mark.slow)
        for a in (f.arch for f in FAMILIES.values() if f.arch in NEW_FAMILIES and not f.router_hooks)
    ],
)
def test_lora_on_the_dense_families_pushes_peft_s_merge(family_models, arch):
    """Only the adapters train, the step-0 gates are exact, and the push is PEFT's own merge (the
    mixture-of-experts families, their experts adapted: tests/test_lora_experts.py)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.test_lora import lora_run

    path = family_models[arch]
    result = run_ranks(1, lora_run, path)[0]
    first = result["outputs"][0]
    assert first.steps[0]["kl_loss"] == 0.0 and first.precision["ref_max_abs_diff"] == 0.0
    assert all(".lora_A." in n or ".lora_B." in n for n in result["trainable"])
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    peft_model.load_state_dict({"base_model.model." + n: t for n, t in result["after"].items()}, strict=False)
    merged = peft_model.merge_and_unload().state_dict()
    assert result["exported"].keys() == merged.keys()
    for name, tensor in result["exported"].items():
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=0)


def test_a_released_qwen3_5_checkpoint_is_the_vision_language_family():
    """Qwen3.5's released config.json says model_type qwen3_5 (qwen3_5_moe): the vision-language
    model, its own family (tests/test_qwen3_5_vl.py runs it), apart from its text model, which the
    Megatron backend builds from it; FSDP never packs either's gated delta-net layers (Megatron
    does)."""
    from slime.utils.model_families import FAMILIES, family, is_vision, megatron_refusal, packable, refusal

    for released, text in (("qwen3_5", "qwen3_5_text"), ("qwen3_5_moe", "qwen3_5_moe_text")):
        assert family(released) is not family(text) and is_vision(released) and not is_vision(text)
        assert not packable(released) and not packable(text) and packable(text, "megatron")
        assert megatron_refusal(released) is None and megatron_refusal(text) is None
        assert FAMILIES[released].text_model == text and "language model" in FAMILIES[released].megatron_scope
    assert refusal("qwen3_5_moe", "router_hooks") is None and refusal("qwen3", "router_hooks")
    assert packable("qwen3") and packable("some_future_model")  # unknown: packs, as before


def test_fp32_routing_flags_leave_a_sigmoid_routers_logits_alone(family_models):
    """--moe-router-dtype fp32 with DeepSeek-V3 (which routes in float32 by itself) changes nothing:
    the trained model's log-probs stay Hugging Face's."""
    import dataclasses

    from tests.test_fsdp_actor import base_config, make_batch

    path = family_models["deepseek_v3"]
    cfg = base_config(path)
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, moe_router_dtype="fp32"))
    result = run_ranks(1, _log_probs, cfg)[0]
    assert result["routing"] == (True, None)  # sigmoid routers, left to route in their own float32
    from transformers import AutoModelForCausalLM

    from tests.test_engine_server import teacher_forced_logprobs

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = make_batch(0)
    for i, (tokens, n) in enumerate(zip(batch.tokens, batch.response_lengths)):
        ref = teacher_forced_logprobs(hf, tokens[:-n], tokens[-n:], 1.0)
        assert (torch.tensor(result["log_probs"][i]) - ref).abs().max() < 1e-5, i


def _log_probs(rank, world_size, init_method, cfg):
    from slime.backends.fsdp.actor import FSDPTrainActor
    from tests.test_fsdp_actor import make_batch

    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    actor.init()
    routing = actor.backend.routing and (actor.backend.routing.sigmoid, actor.backend.routing.dtype)
    out = {"routing": routing, "log_probs": actor.compute_log_probs(make_batch(0))}
    actor.close()
    return out
