"""The torch engine serves PEFT adapters on mixture-of-experts layers' fused experts and routers
(slime.engines.torch_engine.lora_experts), in PEFT's own layout, for every MoE family: on a real
server, an adapter loaded from its directory or pushed as tensors gives PEFT's own model's tokens
and log-probs and routing, rows with and without adapters share a batch, and what PEFT's layout
does not allow is refused by name."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[lora]')")

from tests.conftest import FAMILY_SIZE, make_model, start_engine
from tests.test_engine_lora import output, post

PROMPTS = [[5, 17, 33, 8, 61], [9, 4, 77], [12, 40, 2, 88, 23, 51, 6]]
NEW_TOKENS = 4

FAMILIES = [
    "qwen3_moe",
    "deepseek_v3",  # a sigmoid router with groups and an expert bias, multi-latent attention
    *(
        pytest.param(a, marks=pytest.mark.slow)
        for a in ("glm4_moe", "glm4_moe_lite", "qwen3_next", "qwen3_5_moe")
    ),
]


def make_adapter(base: str, out: str, seed: int) -> str:
    """PEFT's all-linear adapter, which on transformers 5 also wraps the fused experts and the
    router (Qwen3.5's experts named, which all-linear misses), with B scaled up so that the
    adapter moves the routing; kv_b_proj is left out (the engine runs multi-latent attention in
    the absorbed form, where it applies no adapter)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    experts = {}
    if model.config.model_type.startswith("qwen3_5_moe"):
        experts = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    torch.manual_seed(seed)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules="all-linear",
        exclude_modules=["kv_b_proj"],
        init_lora_weights=False,
        **experts,
    )
    model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)
    model.save_pretrained(out)
    return out


@dataclass
class Family:
    arch: str
    base: str
    adapters: dict[str, str]
    dump_dir: str
    url: str


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """One family's tiny model, two adapters of it, and an engine serving `e1` from the start."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    base = make_model(str(root / "model"), 0, "--arch", arch, *FAMILY_SIZE)
    adapters = {name: make_adapter(base, str(root / name), seed) for name, seed in (("e1", 1), ("e2", 2))}
    dump_dir = root / "dumps"
    dump_dir.mkdir()
    proc = start_engine(
        base,
        tmp_path_factory.mktemp("engine-logs"),
        "--enable-lora",
        "--enable-return-routed-experts",
        "--debug-dump-dir",
        str(dump_dir),
        "--lora-paths",
        f"e1={adapters['e1']}",
    )
    yield Family(arch, base, adapters, str(dump_dir), proc.url)
    proc.stop()


def reference(base: str, adapter: str | None):
    """PEFT's model with `adapter` (or the base model), float32, eval."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return (PeftModel.from_pretrained(model, adapter) if adapter else model).eval()


def teacher_forced(model, prompt: list[int], tokens: list[int]) -> tuple[list[float], torch.Tensor]:
    """log p of each of `tokens` after `prompt`, and each MoE layer's top-k experts of every token
    but the last ([tokens, MoE layers, k], sorted: the order of a top-k is no part of routing)."""
    routed: dict[int, torch.Tensor] = {}
    hooks = []
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for li, layer in enumerate(base.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        gate = gate.get_base_layer() if hasattr(gate, "get_base_layer") else gate
        if hasattr(gate, "top_k"):
            hooks.append(gate.register_forward_hook(lambda m, a, out, li=li: routed.__setitem__(li, out[2])))
    ids = torch.tensor([prompt + tokens])
    try:
        with torch.no_grad():
            logits = model(ids[:, :-1]).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    lp = torch.log_softmax(logits[len(prompt) - 1 :], dim=-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    experts = torch.stack([routed[li] for li in sorted(routed)], dim=1).sort(dim=-1).values
    return lp.tolist(), experts.to(torch.int32)


def greedy(model, prompt: list[int]) -> list[int]:
    """`generate`'s greedy tokens, never stopped by an end-of-sequence token (the engine's ignore_eos)."""
    import copy

    config = copy.copy(model.generation_config)
    config.do_sample, config.eos_token_id, config.max_new_tokens = False, [], NEW_TOKENS
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()


def generate(url: str, loras: list[str | None], **sampling) -> list[dict]:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True, **sampling}
    body = {
        "input_ids": PROMPTS,
        "lora_path": loras,
        "return_logprob": True,
        "return_routed_experts": True,
        "sampling_params": params,
    }
    status, results = post(url, "/generate", body)
    assert status == 200, results
    assert isinstance(results, list)
    return results


def routed_experts(result: dict, prompt: list[int], num_layers: int) -> torch.Tensor:
    """meta_info's routed experts of every token but the last, MoE layers only, sorted."""
    tokens = len(prompt) + len(result["output_ids"])
    raw = base64.b64decode(result["meta_info"]["routed_experts"])
    routed = torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(tokens - 1, num_layers, -1)
    moe = [li for li in range(num_layers) if routed[:, li].any()]
    return routed[:, moe].sort(dim=-1).values


def check_rows(family: Family, results: list[dict], loras: list[str | None], greedy_tokens: bool) -> None:
    """Each row's log-probs (and routing, and greedy tokens) are PEFT's with its adapter, or the
    base model's for a row without one."""
    for prompt, lora, result in zip(PROMPTS, loras, results, strict=True):
        model = reference(family.base, family.adapters[lora] if lora else None)
        tokens, lps = output(result)
        expected, experts = teacher_forced(model, prompt, tokens)
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(expected), rtol=0, atol=1e-5)
        layers = model.config.get_text_config().num_hidden_layers
        assert torch.equal(routed_experts(result, prompt, layers), experts), (family.arch, lora)
        if greedy_tokens:
            assert tokens == greedy(model, prompt), (family.arch, lora)


def test_each_row_gets_peft_s_tokens_log_probs_and_routing(family):
    """One batch: e1 (loaded at start), the base model, e2 (loaded by route). Greedy tokens are
    PeftModel.generate's; log-probs are a teacher-forced PeftModel forward's within 1e-5, and the
    experts each token was routed to (what routing replay records) are PEFT's. Sampled outputs too.
    The adapters (B scaled up) change tokens and routing, so a missing router or expert term shows."""
    status, _ = post(
        family.url, "/load_lora_adapter", {"lora_name": "e2", "lora_path": family.adapters["e2"]}
    )
    assert status == 200
    try:
        loras = ["e1", None, "e2"]
        greedy_results = generate(family.url, loras)
        check_rows(family, greedy_results, loras, greedy_tokens=True)
        sampled = generate(family.url, ["e2", "e1", None], temperature=1.0, sampling_seed=7)
        check_rows(family, sampled, ["e2", "e1", None], greedy_tokens=False)
        base = generate(family.url, [None] * 3)
        assert output(base[1]) == output(greedy_results[1])
        assert (
            output(base[0])[0] != output(greedy_results[0])[0]
            or output(base[2])[0] != output(greedy_results[2])[0]
        )
        assert base[0]["meta_info"]["routed_experts"] != greedy_results[0]["meta_info"]["routed_experts"]
    finally:
        post(family.url, "/unload_lora_adapter", {"lora_name": "e2"})


def pushed(family: Family, name: str, config: dict, tensors: dict[str, torch.Tensor]) -> tuple[int, dict]:
    """/load_lora_adapter_from_tensors with a shared-memory handle, as the adapter push sends."""
    from slime.utils.shm_tensors import pack_named_tensors

    handle, buffer = pack_named_tensors(sorted(tensors.items()))
    try:
        body = {"lora_name": name, "config_dict": config, "serialized_named_tensors": [handle]}
        status, answer = post(family.url, "/load_lora_adapter_from_tensors", body)
    finally:
        buffer.close()
    assert isinstance(answer, dict)
    return status, answer


def stored(family: Family, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """An adapter directory's config and tensors, as the adapter push sends them."""
    from safetensors.torch import load_file

    path = family.adapters[name]
    config = json.loads(open(f"{path}/adapter_config.json").read())
    return config, load_file(f"{path}/adapter_model.safetensors")


def test_an_adapter_pushed_as_tensors_serves_and_dumps_like_its_directory(family):
    """The same tensors by /load_lora_adapter_from_tensors serve the same tokens and log-probs as
    the directory, to the bit in the same place of the same batch; the engine's parameter dump
    holds every tensor of both, as stored, under dump_name's names (PEFT's module names)."""
    config, tensors = stored(family, "e1")
    status, answer = pushed(family, "pushed", config, tensors)
    assert status == 200, answer
    try:
        for loras in (["e1", "pushed", None], ["e1", "e1", "e1"]):
            swapped = [{"e1": "pushed", "pushed": "e1"}[n] if n else None for n in loras]
            assert [output(r) for r in generate(family.url, loras)] == [
                output(r) for r in generate(family.url, swapped)
            ]
        status, _ = post(family.url, "/slime/dump_parameters", {"path": "d"})
        assert status == 200
        from slime.utils.peft_files import LORA_TENSOR, dump_name

        for key, t in tensors.items():
            m = LORA_TENSOR.match(key)
            assert m is not None
            for adapter in ("e1", "pushed"):
                held = torch.load(f"{family.dump_dir}/d/{dump_name(adapter, m.group(1), m.group(2))}")
                assert torch.equal(held, t), (adapter, key)
    finally:
        post(family.url, "/unload_lora_adapter", {"lora_name": "pushed"})


def _wrong_shape(config: dict, tensors: dict) -> tuple[dict, dict, str]:
    key = next(k for k in tensors if k.endswith("mlp.experts.lora_B.weight"))
    t = tensors[key]
    return config, {**tensors, key: t[:-1]}, f"tensor {key!r} has shape {(t.shape[0] - 1, t.shape[1])}"


def _not_wrapped(config: dict, tensors: dict) -> tuple[dict, dict, str]:
    key = next(k for k in tensors if k.endswith("mlp.experts.base_layer.lora_A.weight"))
    targets = [t for t in config["target_parameters"] if not t.endswith("gate_up_proj")]
    return {**config, "target_parameters": targets}, tensors, f"tensor {key!r} adapts a parameter of"


def _other_scaling(config: dict, tensors: dict) -> tuple[dict, dict, str]:
    return (
        {**config, "rank_pattern": {".*\\.gate_up_proj": 8}, "alpha_pattern": {}},
        tensors,
        ("rank_pattern/alpha_pattern '.*\\\\.gate_up_proj' gives rank 8 and alpha 8, a scaling other than"),
    )


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"], indirect=True)
@pytest.mark.parametrize(
    "change", [_wrong_shape, _not_wrapped, _other_scaling], ids=["shape", "not-wrapped", "scaling"]
)
def test_refusals_name_the_tensor_or_the_pattern(family, change):
    """A 400 naming the adapter and what is wrong: an expert factor of the wrong shape (with the
    expected one), a tensor of a parameter the config's target_parameters do not wrap, a
    rank_pattern that gives the experts another scaling; nothing is loaded. (The layout is every
    family's: two of them, a softmax and a sigmoid router.)"""
    config, tensors, message = change(*stored(family, "e1"))
    status, answer = pushed(family, "bad", config, tensors)
    assert status == 400 and answer["success"] is False
    assert "LoRA adapter 'bad'" in answer["error_message"] and message in answer["error_message"], answer
    assert "bad" not in answer["loaded_adapters"]


def test_unused_adapters_leave_the_model_bitwise_and_count_their_parameters(family):
    """In process: with an adapter loaded, a forward whose rows use none is transformers' own, to
    the bit; one whose every row uses it differs. info() counts each adapted linear layer and
    parameter (the experts' two, the router's) once."""
    from transformers import AutoModelForCausalLM

    from slime.engines.torch_engine.lora import ServedAdapters

    model = AutoModelForCausalLM.from_pretrained(family.base, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0], PROMPTS[2][:5]])
    with torch.no_grad():
        before = model(ids).logits
        served = ServedAdapters(model)
        config, tensors = stored(family, "e1")
        served.load("e1", config, tensors, "e1")
        unused = model(ids).logits
        with served.rows([served.adapters["e1"]] * 2):
            adapted = model(ids).logits
    assert torch.equal(unused, before)
    assert (adapted - before).abs().max() > 0.1
    assert served.adapters["e1"].info()["num_layers"] == len(tensors) // 2
