"""The model families beyond Qwen2/Qwen3 (slime.utils.model_families), each from
`make_tiny_model --arch`: served by the torch engine like Hugging Face's own forward, trained by
the FSDP actor on two ranks like on one with a step-0 KL of exactly 0, refused by name by the
Megatron backend, and listed in docs/models.md as the registry says."""

from __future__ import annotations

import math
import os

import pytest
import torch

from slime.tools.tiny_families import NEW_FAMILIES
from slime.utils.model_families import FAMILIES, models_table
from tests.conftest import make_model
from tests.dist_helpers import run_ranks
from tests.test_engine_generic import assert_serves_like_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = (
    "--hidden-size",
    "64",
    "--num-layers",
    "2",
)  # two layers: a linear and a full one, a dense and a MoE one


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {arch: make_model(str(root / arch), 0, "--arch", arch, *SIZE) for arch in NEW_FAMILIES}


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
    for arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        assert config(arch)["layer_types"] == ["linear_attention", "full_attention"], arch
    by_type = {f.arch: f for f in FAMILIES.values()}
    for arch in NEW_FAMILIES:  # the registry knows each by the model_type the checkpoint says
        assert FAMILIES[config(arch)["model_type"]] is by_type[arch]


# One of each new kind in the default run (hybrid linear attention, multi-latent attention,
# sigmoid routing with the expert bias); the others in the slow run.
DEFAULT_ENGINE = ("qwen3_next", "deepseek_v3", "glm4_moe")


@pytest.mark.parametrize(
    "arch", [a if a in DEFAULT_ENGINE else pytest.param(a, marks=pytest.mark.slow) for a in NEW_FAMILIES]
)
def test_the_engine_serves_each_family_like_hugging_face(family_models, tmp_path, arch):
    """Greedy tokens equal `generate`; sampled log-probs a teacher-forced forward within 1e-5
    (the hybrid families' per-sequence cache holds each linear layer's recurrent state)."""
    from transformers import AutoModelForCausalLM

    path = family_models[arch]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_serves_like_hf(path, model, [[5, 6, 7], [10, 11, 12, 13, 14, 15], [40]], tmp_path, "GenericRunner")


def _train(rank, world_size, init_method, model):
    from slime.backends.fsdp.actor import FSDPTrainActor
    from tests.test_fsdp_actor import base_config, make_batch

    cfg = base_config(model, use_dynamic_batch_size=True, max_tokens_per_gpu=48)
    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    actor.init()
    log_probs = actor.compute_log_probs(make_batch(0))
    before = {n: p.full_tensor().detach().clone() for n, p in actor.model.named_parameters()}
    outputs = [actor.train(r, make_batch(r)) for r in range(2)]
    after = {n: p.full_tensor().detach().clone() for n, p in actor.model.named_parameters()}
    exported = [n for bucket in actor.export_weights(bucket_bytes=200_000) for n, _ in bucket]
    result = dict(outputs=outputs, before=before, after=after, exported=exported, packed=actor.packs_sequences,
                  log_probs=log_probs)  # fmt: skip
    actor.close()
    return result


@pytest.mark.parametrize("arch", NEW_FAMILIES)
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


def test_megatron_refuses_each_family_by_name(family_models):
    from transformers import AutoConfig

    from slime.backends.megatron.convert import ConversionError, Layout

    for arch in NEW_FAMILIES:
        config = AutoConfig.from_pretrained(family_models[arch])
        with pytest.raises(ConversionError, match="--train-backend fsdp") as info:
            Layout.from_hf_config(config)
        assert config.model_type in str(info.value)


def test_docs_models_table_is_the_registry():
    with open(os.path.join(ROOT, "docs", "models.md")) as f:
        assert models_table() in f.read()


def test_what_a_family_lacks_is_refused_by_name(family_models, tmp_path, capsys):
    """LoRA and the router hooks (R3, R2, the aux loss) are not built for the new families yet:
    their flags exit 2 naming the family, before anything starts."""
    from tests.test_flag_surface import base, error

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    glm = family_models["glm4_moe"]
    err = error(capsys, base(glm, str(prompts), "--use-rollout-routing-replay"))
    assert "--use-rollout-routing-replay: routing replay and the router's aux loss are not built for " in err
    assert "'glm4_moe'" in err
    err = error(capsys, base(family_models["qwen3_next"], str(prompts), "--moe-aux-loss-coeff", "0.01"))
    assert "--moe-aux-loss-coeff: routing replay" in err and "'qwen3_next'" in err
    err = error(capsys, base(family_models["deepseek_v3"], str(prompts), "--lora-rank", "4", "--target-modules",
                             "all-linear"))  # fmt: skip
    assert "--lora-rank 4: LoRA is not built for model_type 'deepseek_v3'" in err
    err = error(capsys, base(glm, str(prompts), "--train-backend", "megatron"))
    assert "'glm4_moe'" in err and "use --train-backend fsdp" in err


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_hybrid_models_state_survives_a_pause_and_a_push(family_models, tmp_path, mode):
    """Qwen3-Next's linear-attention state across pause/continue and a weight push of the same
    weights: retracted (recomputed from the tokens) or kept in place, the tokens are those of a
    request that ran alone."""
    import asyncio

    from slime.engines.client import EngineClient
    from tests.conftest import start_engine
    from tests.test_continuous import GREEDY, _push_during

    path = family_models["qwen3_next"]
    prompt = [5, 6, 7, 8, 9]

    async def go(url):
        async with EngineClient(url) as c:
            alone = await c.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True)
            return alone, await _push_during(c, path, f"{mode}-1", mode, prompt)

    with start_engine(path, tmp_path) as eng:
        alone, out = asyncio.run(go(eng.url))
    assert len(out["meta_info"]["weight_version_spans"]) == 2  # the push landed mid-request
    assert out["meta_info"]["weight_version_spans"][-1][0] == f"{mode}-1"
    assert out["output_ids"] == alone["output_ids"]
    lp, ref = ([x[0] for x in r["meta_info"]["output_token_logprobs"]] for r in (out, alone))
    assert max(abs(a - b) for a, b in zip(lp, ref)) < 1e-5
