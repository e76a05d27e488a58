"""LoRA on a mixture-of-experts model's fused experts and router in the FSDP actor, in PEFT's
layout (slime.utils.peft_experts): `all-linear` (and the expert names) reach them where PEFT maps
them, `--target-parameters` names them; only the adapters train, step 0 is the base model, the
push is PEFT's own merge (per expert, under the checkpoint's names), `--save-hf` is a directory
PEFT loads and `--lora-adapter-path` starts from."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[lora]')")

from tests.conftest import FAMILY_SIZE, make_model
from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import make_batch
from tests.test_lora import lora_run

ALL = ("all-linear",)
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def peft_merge(model_dir: str, after: dict[str, torch.Tensor], parameters=()) -> dict[str, torch.Tensor]:
    """PEFT's merge_and_unload of the trained adapters, under the checkpoint's names."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from slime.utils import hf_experts

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=[] if parameters else "all-linear",
        target_parameters=list(parameters) or None,
    )
    model = get_peft_model(hf, config)
    loaded = model.load_state_dict({"base_model.model." + n: t for n, t in after.items()}, strict=False)
    assert not loaded.unexpected_keys
    merged = model.merge_and_unload().state_dict()
    return dict(hf_experts.checkpoint_tensors(hf.config.model_type, merged.items()))


def check_run(result: dict, model_dir: str, hf_dir: str, parameters=()) -> None:
    trainable = result["trainable"]
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert any(".mlp.experts.lora_A." in n for n in trainable)  # the experts' adapters train
    changed = {n for n, t in result["before"].items() if not torch.equal(t, result["after"][n])}
    assert changed == set(trainable)
    first = result["outputs"][0]
    assert first.steps[0]["ppo_kl"] == 0.0 and first.precision["first_step_max_abs_diff"] == 0.0
    merged = peft_merge(model_dir, result["after"], parameters)
    exported = result["exported"]
    assert set(exported) == set(merged) - ({"lm_head.weight"} if "lm_head.weight" not in exported else set())
    for name, tensor in exported.items():
        assert torch.equal(tensor, merged[name]), name
    params = {n: tuple(t.shape) for n, t in exported.items() if not n.endswith("e_score_correction_bias")}
    assert params == result["shapes"]  # (weight_shapes: the parameters, not the buffers)
    # the experts' merged weights moved, and so did every router PEFT adapted
    from safetensors.torch import load_file

    base = load_file(os.path.join(model_dir, "model.safetensors"))
    moved = {n for n in exported if n in base and not torch.equal(exported[n], base[n].float())}
    assert any(".mlp.experts.0." in n for n in moved)
    for name in base:  # the checkpoint's buffers (an expert-score bias) go out as loaded
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(exported[name], base[name]), name
    check_save_hf(result, model_dir, hf_dir)


def check_save_hf(result: dict, model_dir: str, hf_dir: str) -> None:
    """PEFT loads --save-hf's directory and computes what the pushed weights compute."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), hf_dir
    ).eval()
    merged = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    from slime.utils import hf_experts

    fused = dict(merged.state_dict())
    for name, where in hf_experts.checkpoint_slices(
        merged.config.model_type, {n: t.shape for n, t in fused.items()}
    ).items():
        where.view(fused[where.fused]).copy_(result["exported"][name])
    merged.load_state_dict({n: t for n, t in result["exported"].items() if n in fused}, strict=False)
    tokens = torch.tensor([make_batch(0).tokens[0]])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(tokens).logits, merged(tokens).logits, rtol=0, atol=2e-5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-lora")
    return lambda arch: make_model(str(root / arch), 0, "--arch", arch, *FAMILY_SIZE)


@pytest.mark.parametrize(
    "arch",
    [
        "qwen3_moe",
        "deepseek_v3",
        pytest.param("glm4_moe", marks=pytest.mark.slow),
        pytest.param("glm4_moe_lite", marks=pytest.mark.slow),
        pytest.param("qwen3_next", marks=pytest.mark.slow),
    ],
)
def test_all_linear_adapts_the_experts_and_the_push_is_peft_s_merge(models, arch, tmp_path):
    """PEFT's all-linear on a family it maps: the attention, the fused experts (gate_up_proj at
    twice the rank) and the router get adapters; after two rollouts the push is bit for bit
    PEFT's merge_and_unload of the trained adapters, one tensor per expert; --save-hf loads in
    PEFT with its target_parameters and rank pattern, and --lora-adapter-path starts from it."""
    model_dir, hf_dir = models(arch), str(tmp_path / "hf")
    result = run_ranks(1, lora_run, model_dir, ALL, (), None, None, 2, hf_dir)[0]
    assert any(".mlp.gate.lora_A." in n for n in result["trainable"])
    check_run(result, model_dir, hf_dir)
    config = json.load(open(os.path.join(hf_dir, "adapter_config.json")))
    assert set(config["target_parameters"]) == {"gate_up_proj", "down_proj", "gate.weight"}
    assert config["rank_pattern"] == {r".*\.gate_up_proj": 8} and config["alpha_pattern"] == {
        r".*\.gate_up_proj": 16
    }
    again = run_ranks(1, lora_run, model_dir, ALL, (), None, None, 0, None, hf_dir)[0]
    for name in result["trainable"]:
        assert torch.equal(again["before"][name], result["after"][name]), name


def test_two_ranks_train_the_experts_adapters_like_one(models):
    """PEFT puts the experts' adapted weight in place around every forward; over two FSDP ranks
    (the experts' factors sharded) the steps and the merged push are one rank's."""
    model_dir = models("qwen3_moe")
    one = run_ranks(1, lora_run, model_dir, ALL, (), None, None, 2)[0]
    two = run_ranks(2, lora_run, model_dir, ALL, (), None, None, 2)[0]
    for a, b in zip(one["outputs"], two["outputs"], strict=True):
        for sa, sb in zip(a.steps, b.steps, strict=True):
            for key in sa:
                assert sb[key] == pytest.approx(sa[key], rel=2e-5, abs=1e-6), key
    for name, tensor in one["exported"].items():
        torch.testing.assert_close(two["exported"][name], tensor, rtol=0, atol=1e-6, msg=name)
    assert any(
        not torch.equal(one["before"][n], one["after"][n]) for n in one["trainable"] if ".experts." in n
    )


def test_target_parameters_adapt_the_experts_peft_s_all_linear_leaves(models, tmp_path):
    """Qwen3.5-MoE: PEFT's all-linear reaches its shared expert, not its routed experts;
    --target-parameters mlp.experts.gate_up_proj,mlp.experts.down_proj adapts those (rank r
    each), and the push is PEFT's merge of that config."""
    model_dir, hf_dir = models("qwen3_5_moe"), str(tmp_path / "hf")
    result = run_ranks(1, lora_run, model_dir, (), (), None, None, 2, hf_dir, None, False, EXPERTS)[0]
    assert {n.split(".lora_")[0].split("mlp.")[-1] for n in result["trainable"]} == {
        "experts",
        "experts.base_layer",
    }
    check_run(result, model_dir, hf_dir, EXPERTS)


@pytest.mark.parametrize(
    "targets, parameters, dropout, message",
    [
        (ALL, (), 0.1, "--lora-dropout: PEFT refuses these adapters on this model"),
        (("gate_proj",), (), 0.0, "PEFT refuses these adapters on this model: Cannot convert PEFT target"),
        (
            (),
            ("mlp.experts.up_proj",),
            0.0,
            "--target-parameters mlp.experts.up_proj: no parameter of this model",
        ),
        (
            ("expert_proj",),
            (),
            0.0,
            "its experts and router: --target-parameters \\(PEFT maps gate_proj,up_proj,down_proj,gate",
        ),
    ],
    ids=["dropout", "half-of-a-fused-pair", "unknown-parameter", "unknown-module"],
)
def test_lora_on_experts_refuses_what_peft_cannot_build(models, targets, parameters, dropout, message):
    with pytest.raises(Exception, match=message):
        run_ranks(
            1,
            lora_run,
            models("qwen3_moe"),
            targets,
            (),
            None,
            None,
            0,
            None,
            None,
            False,
            parameters,
            dropout,
        )


def test_routing_replay_hooks_a_router_peft_wraps(models):
    """LoRA on the router wraps it in PEFT's ParamWrapper; the routing hooks (R2, R3, the router
    dtype, the aux loss) go on the router inside, where they see the adapted weight."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    from slime.utils.hf_experts import find_routers

    model = AutoModelForCausalLM.from_pretrained(models("qwen3_moe"), dtype=torch.float32)
    plain = find_routers(model.model.layers)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = inject_adapter_in_model(config, model)
    routers = find_routers(model.model.layers)
    assert routers.keys() == plain.keys() and all(routers[k] is plain[k] for k in plain)
    seen = []
    for router in routers.values():
        router.register_forward_hook(lambda m, args, out: seen.append((m, args[0], out[0])))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]]))
        assert len(seen) == len(routers)
        for router, hidden, logits in seen:
            wrapper = next(m for m in model.modules() if getattr(m, "base_layer", None) is router)
            adapted = router.weight + wrapper.get_delta_weight("default")
            torch.testing.assert_close(logits, torch.nn.functional.linear(hidden, adapted))
            assert not torch.allclose(logits, torch.nn.functional.linear(hidden, router.weight))


def test_experts_stored_transposed_are_refused(models):
    """Fused experts in another layout (gpt-oss's: each expert [in, out], `is_transposed`) would
    merge wrong under these rules: refused by name, not pushed."""
    from transformers import AutoModelForCausalLM

    from slime.backends.fsdp.lora import inject
    from slime.config.lora import LoRAConfig
    from slime.utils.errors import UsageError

    model = AutoModelForCausalLM.from_pretrained(models("qwen3_moe"), dtype=torch.float32)
    for module in model.modules():
        if hasattr(module, "gate_up_proj"):
            module.is_transposed = True
    with pytest.raises(
        UsageError, match=r"PEFT adapts model\.layers\.\d\.mlp\.experts\.\w+, experts in a layout"
    ):
        inject(model, LoRAConfig(rank=4, alpha=8, target_modules=ALL))
