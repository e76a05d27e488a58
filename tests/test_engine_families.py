"""The torch engine on each model family (slime.utils.model_families), each from `make_tiny_model
--arch`: served on the runner the registry names like Hugging Face's own forward, with each
attention kind's cache (multi-latent attention's latent, a hybrid's linear-attention states)."""

from __future__ import annotations

import pytest
import torch

from slime.tools.tiny_families import NEW_FAMILIES
from slime.utils.model_families import BATCHED, FAMILIES
from tests.test_engine_generic import assert_serves_like_hf
from tests.test_engine_moe import routed_by_layer

# Hybrid linear attention, multi-latent attention (with sigmoid routing and the expert bias) and
# GLM-4's layers on the batched runner in the default run; the others in the slow run.
DEFAULT_ENGINE = ("qwen3_next", "deepseek_v3", "glm4")


@pytest.mark.parametrize(
    "arch", [a if a in DEFAULT_ENGINE else pytest.param(a, marks=pytest.mark.slow) for a in NEW_FAMILIES]
)
def test_the_engine_serves_each_family_like_hugging_face(family_models, tmp_path, arch):
    """Greedy tokens equal `generate`; sampled log-probs a teacher-forced forward within 1e-5, on
    the runner the registry names (the hybrid families' per-sequence cache holds each linear
    layer's recurrent state; the batched runner rotates and norms as each family's modeling does)."""
    from transformers import AutoModelForCausalLM

    path = family_models[arch]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batched = FAMILIES[model.config.model_type].engine == BATCHED
    runner = "BatchedRunner" if batched else "GenericRunner"
    assert_serves_like_hf(path, model, [[5, 6, 7], [10, 11, 12, 13, 14, 15], [40]], tmp_path, runner)


def test_the_engine_caches_deepseek_v3s_compressed_latent_not_full_keys_and_values(family_models):
    """Multi-latent attention in the batched runner: each layer's cache holds, per token, the
    normalised key/value latent (kv_lora_rank) and the shared rotary key (qk_rope_head_dim) as one
    key of one head, and no value buffer (the values are the latent, read in place)."""
    from transformers import AutoModelForCausalLM

    from slime.engines.torch_engine.model_runner import BatchedRunner
    from slime.engines.torch_engine.sequence import Sequence
    from slime.utils.sampling_params import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(family_models["deepseek_v3"], dtype=torch.float32).eval()
    c = model.config
    runner = BatchedRunner(model, max_running=2, context_length=64)
    seq = Sequence("r", [5, 6, 7, 8], SamplingParams())
    runner.prefill([seq])
    seq.output_ids.append(9)
    runner.decode()
    cache = runner.cache
    assert len(cache.k) == c.num_hidden_layers and cache.v == []
    for keys in cache.k:  # (rows, heads, length, numbers a token)
        assert keys.shape[1] == 1 and keys.shape[3] == c.kv_lora_rank + c.qk_rope_head_dim
    per_token = cache.nbytes() // (cache.rows * cache.length * c.num_hidden_layers * 4)
    full = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    assert per_token == c.kv_lora_rank + c.qk_rope_head_dim < full / 5  # 24 numbers, not 160


def test_the_absorbed_attention_reads_new_weights_after_they_are_copied_in(family_models, tmp_path):
    """A push copies weights into the model's parameters: the next prefill's logits are the new
    model's (the absorbed form keeps no copy of kv_b_proj)."""
    from transformers import AutoModelForCausalLM

    from slime.engines.torch_engine.model_runner import BatchedRunner
    from slime.engines.torch_engine.sequence import Sequence
    from slime.utils.sampling_params import SamplingParams
    from tests.conftest import FAMILY_SIZE, make_model

    model = AutoModelForCausalLM.from_pretrained(family_models["deepseek_v3"], dtype=torch.float32).eval()
    other_path = make_model(str(tmp_path / "other"), 1, "--arch", "deepseek_v3", *FAMILY_SIZE)
    other = AutoModelForCausalLM.from_pretrained(other_path, dtype=torch.float32).eval()
    runner = BatchedRunner(model, max_running=2, context_length=64)
    prompt = [5, 6, 7, 8]
    runner.prefill([Sequence("a", prompt, SamplingParams())])
    runner.release(runner.active[0])
    with torch.no_grad():
        before = model(torch.tensor([prompt])).logits[0, -1]
        for name, tensor in other.state_dict().items():
            model.state_dict()[name].copy_(tensor)
        want = other(torch.tensor([prompt])).logits[0, -1]
    got = runner.prefill([Sequence("b", prompt, SamplingParams())])[0]
    assert (before - want).abs().max() > 1e-3  # the two models differ
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_an_adapter_on_the_absorbed_latent_projection_is_refused_by_name(family_models):
    """The batched runner never calls DeepSeek-V3's kv_b_proj (the absorbed form reads its weight),
    so the engine refuses an adapter on it instead of serving the base projection silently; an
    adapter on a projection it calls loads."""
    from transformers import AutoModelForCausalLM

    from slime.engines.protocol import ProtocolError
    from slime.engines.torch_engine.lora import ServedAdapters
    from slime.engines.torch_engine.model_runner import BatchedRunner

    model = AutoModelForCausalLM.from_pretrained(family_models["deepseek_v3"], dtype=torch.float32).eval()
    runner = BatchedRunner(model, max_running=2, context_length=64)
    adapters = ServedAdapters(model, None, runner.unapplied_linears)

    def adapter(module):
        layer = dict(model.named_modules())["model.layers.0.self_attn." + module]
        prefix = f"base_model.model.model.layers.0.self_attn.{module}"
        return {
            f"{prefix}.lora_A.weight": torch.zeros(2, layer.in_features),
            f"{prefix}.lora_B.weight": torch.zeros(layer.out_features, 2),
        }

    with pytest.raises(ProtocolError, match="kv_b_proj is computed in multi-latent attention's absorbed"):
        adapters.load("latent", {"r": 2, "lora_alpha": 4}, adapter("kv_b_proj"), "/a")
    adapters.load("query", {"r": 2, "lora_alpha": 4}, adapter("q_a_proj"), "/b")
    assert list(adapters.loaded()) == ["query"]


def test_a_hybrid_rows_linear_state_moves_with_it_when_a_row_is_refilled(family_models):
    """Qwen3-Next on the batched runner: three sequences decode together; when the first ends its
    row is refilled by the last, whose convolution and recurrent states move with its keys and
    values, so each step's logits are still a teacher-forced forward's of that sequence alone."""
    from transformers import AutoModelForCausalLM

    from slime.engines.torch_engine.model_runner import BatchedRunner
    from slime.engines.torch_engine.sequence import Sequence
    from slime.utils.sampling_params import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(family_models["qwen3_next"], dtype=torch.float32).eval()
    runner = BatchedRunner(model, max_running=4, context_length=64)
    prompts, lengths = [[5, 6, 7], [10, 11, 12, 13, 14, 15], [40, 41]], [3, 12, 7]
    seqs = [Sequence(str(i), p, SamplingParams()) for i, p in enumerate(prompts)]
    steps: dict[str, list[torch.Tensor]] = {s.rid: [] for s in seqs}

    def take(active, logits):
        for seq, row in zip(active, logits):
            steps[seq.rid].append(row)
            seq.output_ids.append(int(row.argmax()))

    take(seqs, runner.prefill(seqs))
    while runner.active:
        for seq in [s for s, n in zip(seqs, lengths) if s in runner.active and len(s.output_ids) == n]:
            runner.release(seq)  # the first to end: row 0, refilled by row 2
        if runner.active:
            take(*runner.decode())
    for seq, prompt in zip(seqs, prompts, strict=True):
        with torch.no_grad():
            want = model(torch.tensor([prompt + seq.output_ids[:-1]])).logits[0, len(prompt) - 1 :]
        torch.testing.assert_close(torch.stack(steps[seq.rid]), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("arch", "mode"),
    [
        ("qwen3_next", "retract"),
        pytest.param("qwen3_next", "in_place", marks=pytest.mark.slow),
        pytest.param("deepseek_v3", "retract", marks=pytest.mark.slow),
        pytest.param("deepseek_v3", "in_place", marks=pytest.mark.slow),
    ],
)
def test_a_models_cache_survives_a_pause_and_a_push(family_models, tmp_path, arch, mode):
    """A cache of each kind across pause/continue and a weight push of the same weights (Qwen3-Next's
    linear-attention states, DeepSeek-V3's latents, whose absorbed projection is read after the
    push): retracted (recomputed from the tokens) or kept in place, the tokens are those of a
    request that ran alone."""
    import asyncio

    from slime.engines.client import EngineClient
    from tests.conftest import start_engine
    from tests.test_continuous import GREEDY, _push_during

    path = family_models[arch]
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


MOE = ("glm4_moe", "deepseek_v3", "glm4_moe_lite", "qwen3_next", "qwen3_5_moe")


@pytest.mark.parametrize(
    "arch", [a if a == "deepseek_v3" else pytest.param(a, marks=pytest.mark.slow) for a in MOE]
)
def test_the_batched_runner_reports_the_experts_each_family_routes_to(family_models, tmp_path, arch):
    """`return_routed_experts` on the batched runner, two requests batched: every MoE layer's
    experts are those of a teacher-forced Hugging Face forward of the whole sequence (sigmoid
    routers with groups and the expert bias included); a dense layer reports zeros."""
    import asyncio
    import base64

    from transformers import AutoModelForCausalLM

    from slime.engines.client import EngineClient
    from tests.conftest import start_engine

    path = family_models[arch]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers, top_k = model.model.layers, model.config.num_experts_per_tok
    prompts = [[5, 6, 7], [10, 11, 12, 13, 14, 15]]

    async def ask(url):
        async with EngineClient(url) as c:
            params = {"max_new_tokens": 5, "temperature": 0.8, "ignore_eos": True}
            return await c.generate(prompts, sampling_params=params, return_routed_experts=True)

    with start_engine(path, tmp_path, "--enable-return-routed-experts") as eng:
        outputs = asyncio.run(ask(eng.url))
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = prompt + out["output_ids"]
        raw = base64.b64decode(out["meta_info"]["routed_experts"])
        routed = torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(
            len(tokens) - 1, len(layers), top_k
        )
        with routed_by_layer(layers) as chosen, torch.no_grad():
            model(torch.tensor([tokens[:-1]]))
        assert chosen, "no MoE layer"
        for li in range(len(layers)):
            want = chosen[li].to(torch.int32) if li in chosen else torch.zeros_like(routed[:, li])
            assert torch.equal(routed[:, li], want), (arch, li)
