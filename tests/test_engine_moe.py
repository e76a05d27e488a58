"""A mixture-of-experts model (tiny Qwen3-MoE: 4 experts, top-2) in the torch engine's batched
runner: greedy tokens equal Hugging Face's `generate`, sampled log-probs equal a teacher-forced
forward of the whole sequence within the engine's bound, with several requests batched."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from tests.test_engine_generic import assert_serves_like_hf


@pytest.fixture(scope="module")
def moe_model(tiny_moe):
    from transformers import AutoModelForCausalLM

    return tiny_moe, AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()


def test_batched_runner_serves_qwen3_moe(moe_model, tmp_path):
    path, model = moe_model
    prompts = [[5, 6, 7], [10, 11, 12, 13, 14, 15], [40], [22, 23, 24, 25]]
    assert_serves_like_hf(path, model, prompts, tmp_path, "BatchedRunner", sampled_tokens=12)


def test_weight_store_speaks_per_expert_checkpoint_names(moe_model, tmp_path):
    """Updates, fingerprints and dumps of a fused-expert model use the checkpoint's per-expert
    names; the fused module names are accepted too; resume tracks every expert separately."""
    from transformers import AutoModelForCausalLM

    from slime.engines.protocol import ProtocolError
    from slime.engines.torch_engine.weights import WeightStore
    from tests.conftest import make_model
    from tests.test_fsdp_moe import checkpoint_tensors

    path, _ = moe_model
    other = make_model(
        str(tmp_path / "moe-b"), 1, "--arch", "qwen3_moe", "--hidden-size", "64", "--num-layers", "2"
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    store = WeightStore(model)
    target = checkpoint_tensors(other)
    assert store.canonical_names() == sorted(target)

    store.update_from_disk(other)
    expected = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
    for name, value in expected.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], value), name
    snapshot_count = store.snapshot()
    assert snapshot_count == len(target) and store.compare() == ([], "")

    fused = "model.layers.1.mlp.experts.down_proj"
    store.update_from_named([(fused, torch.zeros(4, 64, 32))])
    problems, _ = store.compare()
    assert sorted(p.split()[0] for p in problems) == [
        f"name=model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)
    ]

    with pytest.raises(ProtocolError, match=r"experts\.4\.up_proj.*unknown|unknown.*experts\.4\.up_proj"):
        store.update_from_named([("model.layers.0.mlp.experts.4.up_proj.weight", torch.zeros(32, 64))])
    with pytest.raises(
        ProtocolError, match=r"experts\.0\.up_proj\.weight': shape \[64, 32\] != expected \[32, 64\]"
    ):
        store.update_from_named([("model.layers.0.mlp.experts.0.up_proj.weight", torch.zeros(64, 32))])

    store.release()
    store.resume()
    experts = [n for n in target if ".mlp.experts." in n]
    store.update_from_named([(n, t) for n, t in target.items() if n not in experts[:3]])
    assert store.stale == set(experts[:3])
    store.update_from_named([(n, target[n]) for n in experts[:3]])
    assert not store.stale
    for name, value in expected.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], value), name
    sums = store.checksums([experts[0]])
    assert list(sums) == [experts[0]]


@contextlib.contextmanager
def routed_by_layer(layers) -> Iterator[dict[int, torch.Tensor]]:
    """While open, each forward's top-k experts by decoder layer, for the layers with a router
    (`mlp.gate` with a `top_k`), as Hugging Face's forward routes them: {layer: [tokens, k]}."""
    chosen: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out, li=li: chosen.__setitem__(li, out[2]))
        for li, layer in enumerate(layers)
        if hasattr(getattr(layer.mlp, "gate", None), "top_k")
    ]
    try:
        yield chosen
    finally:
        for h in hooks:
            h.remove()


def hf_routing(model, tokens: list[int]) -> torch.Tensor:
    """The experts Hugging Face's forward routes each token of `tokens` to: [tokens, layers, top-k]."""
    with routed_by_layer(model.model.layers) as chosen, torch.no_grad():
        model(torch.tensor([tokens]))
    return torch.stack([chosen[li] for li in range(len(model.model.layers))], dim=1).to(torch.int32)


def test_routed_experts_are_the_experts_hf_routes_to(moe_model, tmp_path):
    """SGLang's `return_routed_experts`: meta_info "routed_experts" is base64 int32
    [prompt + response - 1 tokens, layers, top-k], here with four requests batched, in prefill and
    decode, and it equals the routing of a teacher-forced forward of the whole sequence."""
    import asyncio
    import base64

    from slime.engines.client import EngineClient, EngineError
    from tests.conftest import start_engine

    path, model = moe_model
    prompts = [[5, 6, 7], [10, 11, 12, 13, 14, 15], [40], [22, 23, 24, 25]]
    params = {"max_new_tokens": 7, "temperature": 0.8, "ignore_eos": True}

    async def ask(url, **kw):
        async with EngineClient(url) as c:
            return await c.generate(prompts, sampling_params=params, return_logprob=True, **kw)

    with start_engine(path, tmp_path, "--enable-return-routed-experts") as eng:
        outputs = asyncio.run(ask(eng.url, return_routed_experts=True))
        plain = asyncio.run(ask(eng.url))
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = prompt + out["output_ids"]
        raw = base64.b64decode(out["meta_info"]["routed_experts"])
        routed = torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(len(tokens) - 1, 2, 2)
        assert torch.equal(routed, hf_routing(model, tokens[:-1]))
    assert all("routed_experts" not in out["meta_info"] for out in plain)

    with (
        start_engine(path, tmp_path) as eng,
        pytest.raises(EngineError, match="--enable-return-routed-experts"),
    ):
        asyncio.run(ask(eng.url, return_routed_experts=True))
