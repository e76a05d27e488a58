"""The torch engine serves LoRA adapters (slime.engines.torch_engine.lora) with SGLang's routes and
fields, on a real server: an adapter loaded from a PEFT directory or from tensors gives the
log-probs PEFT's own model gives, several adapters run in one batch each on its own rows, and
the routes refuse what SGLang refuses."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[lora]')")

from tests.conftest import start_engine
from tests.test_engine_server import raw_post

PROMPTS = [[5, 17, 33, 8, 61], [9, 4, 77], [12, 40, 2, 88, 23, 51, 6]]


def make_adapter(base: str, out: str, seed: int, targets: list[str]) -> str:
    """A PEFT adapter with non-zero B (a trained one's shape, random values)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=targets),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out)
    return out


def reference_log_probs(base: str, adapter: str | None, prompt: list[int], output: list[int]) -> list[float]:
    """log p of each output token, teacher-forced through PEFT's model (or the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter:
        model = PeftModel.from_pretrained(model, adapter)
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model.eval()(ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return lp.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("adapters")
    return {
        "a1": make_adapter(tiny_model, str(out / "a1"), 1, ["q_proj", "v_proj", "down_proj"]),
        "a2": make_adapter(tiny_model, str(out / "a2"), 2, ["o_proj", "gate_proj", "up_proj"]),
    }


@pytest.fixture(scope="module")
def lora_engine(tiny_model, tmp_path_factory, adapters):
    proc = start_engine(
        tiny_model,
        tmp_path_factory.mktemp("engine-logs"),
        "--enable-lora",
        "--lora-paths",
        f"a1={adapters['a1']}",
    )
    yield proc
    proc.stop()


def post(url: str, path: str, body: dict) -> tuple[int, object]:
    return raw_post(url, path, json.dumps(body))


def generate(url: str, loras: list[str | None]) -> list[dict]:
    status, results = post(
        url,
        "/generate",
        {
            "input_ids": PROMPTS,
            "lora_path": loras,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
        },
    )
    assert status == 200, results
    assert isinstance(results, list)
    return results


def output(result: dict) -> tuple[list[int], list[float]]:
    entries = result["meta_info"]["output_token_logprobs"]
    return [e[1] for e in entries], [e[0] for e in entries]


def test_each_row_of_a_batch_runs_with_its_own_adapter(lora_engine, tiny_model, adapters):
    """One batch: a1 (loaded at start, --lora-paths), the base model, a2 (loaded by route): each
    row's tokens and log-probs are PEFT's with that adapter (teacher-forced), within 1e-5."""
    status, answer = post(
        lora_engine.url, "/load_lora_adapter", {"lora_name": "a2", "lora_path": adapters["a2"]}
    )
    assert status == 200 and answer == {
        "success": True,
        "error_message": None,
        "loaded_adapters": {"a1": adapters["a1"], "a2": adapters["a2"]},
    }
    try:
        loras = ["a1", None, "a2"]
        results = generate(lora_engine.url, loras)
        outs = []
        for prompt, lora, result in zip(PROMPTS, loras, results, strict=True):
            tokens, lps = output(result)
            expected = reference_log_probs(tiny_model, adapters[lora] if lora else None, prompt, tokens)
            torch.testing.assert_close(torch.tensor(lps), torch.tensor(expected), rtol=0, atol=1e-5)
            outs.append(tokens)
        base = [output(r) for r in generate(lora_engine.url, [None, None, None])]
        assert base[1][0] == outs[1]
        assert base[0][1] != output(results[0])[1]  # the adapter changes the model
    finally:
        post(lora_engine.url, "/unload_lora_adapter", {"lora_name": "a2"})


def test_an_adapter_pushed_as_tensors_serves_like_its_directory(lora_engine, tiny_model, adapters):
    """/load_lora_adapter_from_tensors (a shared-memory handle, the push's transport) with the
    PEFT config: the same log-probs as the directory; unload frees the name."""
    from safetensors.torch import load_file

    from slime.utils.shm_tensors import pack_named_tensors

    config = json.loads(open(f"{adapters['a1']}/adapter_config.json").read())
    tensors = load_file(f"{adapters['a1']}/adapter_model.safetensors")
    handle, buffer = pack_named_tensors(sorted(tensors.items()))
    try:
        status, answer = post(
            lora_engine.url,
            "/load_lora_adapter_from_tensors",
            {"lora_name": "pushed", "config_dict": config, "serialized_named_tensors": [handle]},
        )
    finally:
        buffer.close()
    assert status == 200 and answer["loaded_adapters"]["pushed"] == "__tensor__"
    from_dir = generate(lora_engine.url, ["a1", "pushed", "a1"])
    pushed = generate(lora_engine.url, ["pushed", "a1", "pushed"])
    for a, b in zip(from_dir, pushed):
        assert output(a) == output(b)
    # upsert (Miles's SGLang field, what the adapter push sends): the loaded adapter's weights are
    # replaced in place, under the same name; without it the name is refused as taken
    a2 = load_file(f"{adapters['a2']}/adapter_model.safetensors")
    handle, buffer = pack_named_tensors(sorted(a2.items()))
    try:
        body = {
            "lora_name": "pushed",
            "config_dict": json.loads(open(f"{adapters['a2']}/adapter_config.json").read()),
            "serialized_named_tensors": [handle],
        }
        status, refused = post(lora_engine.url, "/load_lora_adapter_from_tensors", body)
        assert status == 400 and "already loaded" in refused["error_message"]  # type: ignore[index]
        status, _ = post(lora_engine.url, "/load_lora_adapter_from_tensors", {**body, "upsert": True})
    finally:
        buffer.close()
    assert status == 200
    status, _ = post(lora_engine.url, "/load_lora_adapter", {"lora_name": "a2", "lora_path": adapters["a2"]})
    try:
        for a, b in zip(generate(lora_engine.url, ["pushed"] * 3), generate(lora_engine.url, ["a2"] * 3)):
            assert output(a) == output(b)
    finally:
        post(lora_engine.url, "/unload_lora_adapter", {"lora_name": "a2"})
    status, answer = post(lora_engine.url, "/unload_lora_adapter", {"lora_name": "pushed"})
    assert status == 200 and "pushed" not in answer["loaded_adapters"]


def test_the_adapter_push_checks_what_each_engine_received(lora_engine, adapters):
    """The bridge's adapter push (slime.bridge.adapter, SGLang's flattened_bucket payload) with
    SGLang's expected_checksums: the adapter serves as its directory does and the weight version
    moves; tensors changed on the way are refused (WeightSyncError) and the loaded version stays."""
    from safetensors.torch import load_file

    from slime.bridge import adapter
    from slime.bridge.adapter import push_adapter
    from slime.bridge.bridge import WeightBridge
    from slime.bridge.tensor import TensorTransport
    from slime.bridge.verify import WeightSyncError
    from slime.utils.async_utils import run_sync
    from slime.utils.flattened_bucket import flatten, serialize
    from slime.utils.shm_tensors import SharedBuffer

    config = json.loads(open(f"{adapters['a1']}/adapter_config.json").read())
    named = sorted(load_file(f"{adapters['a1']}/adapter_model.safetensors").items())
    bridge = WeightBridge(TensorTransport(), [lora_engine.url])
    try:
        stats = run_sync(push_adapter(bridge, named, config, "7", checksums=True, name="checked"))
        assert stats["bytes"] == sum(t.numel() * t.element_size() for _, t in named)
        pushed, from_dir = generate(lora_engine.url, ["checked"] * 3), generate(lora_engine.url, ["a1"] * 3)
        assert [output(r) for r in pushed] == [output(r) for r in from_dir]
        assert pushed[0]["meta_info"]["weight_version"] == "7"
        tampered = [(n, t + 1.0 if i == 1 else t) for i, (n, t) in enumerate(named)]
        shm = SharedBuffer.create(sum(t.numel() * t.element_size() + 16 for _, t in named))
        try:
            flat, metadata = flatten(tampered, shm.data)
            payload = serialize(flat, metadata, False, shm.path)
            with pytest.raises(
                WeightSyncError, match=f"adapter sync MISMATCH.*1 differ \\['{named[1][0]}'\\]"
            ):
                run_sync(adapter.push(bridge, named, config, "8", [[payload]], True, "checked"))
        finally:
            shm.close()
        after = generate(lora_engine.url, ["checked"] * 3)
        assert [output(r) for r in after] == [output(r) for r in from_dir]
    finally:
        post(lora_engine.url, "/unload_lora_adapter", {"lora_name": "checked"})
        run_sync(bridge.close())


@pytest.mark.parametrize(
    "path, body, message",
    [
        (
            "/generate",
            {"input_ids": [1, 2], "lora_path": "nope"},
            "the requested LoRA adapter 'nope' is not loaded",
        ),
        (
            "/load_lora_adapter",
            {"lora_name": "a1", "lora_path": "/tmp"},
            "LoRA adapter 'a1' is already loaded",
        ),
        ("/unload_lora_adapter", {"lora_name": "nope"}, "LoRA adapter 'nope' is not loaded"),
        (
            "/load_lora_adapter",
            {"lora_name": "x", "lora_path": "/nonexistent"},
            "cannot read LoRA adapter 'x'",
        ),
        (
            "/load_lora_adapter_from_tensors",
            {"lora_name": "x", "config_dict": {"r": 4, "lora_alpha": 8}},
            "'serialized_named_tensors' must be a list",
        ),
    ],
    ids=["unknown-adapter", "name-taken", "unload-unknown", "bad-path", "no-tensors"],
)
def test_refusals_name_the_adapter(lora_engine, path, body, message):
    status, answer = post(lora_engine.url, path, body)
    assert status == 400
    text = answer.get("error_message") or answer.get("message")  # type: ignore[union-attr]
    assert message in text, answer
    if path != "/generate":
        assert answer["success"] is False  # type: ignore[index]


def test_an_engine_without_enable_lora_refuses_adapters(engine):
    status, answer = post(engine.url, "/generate", {"input_ids": [1, 2], "lora_path": "a1"})
    assert status == 400 and "--enable-lora" in answer["message"]  # type: ignore[index]
    status, answer = post(engine.url, "/load_lora_adapter", {"lora_name": "a1", "lora_path": "/tmp"})
    assert status == 400 and answer["success"] is False  # type: ignore[index]
    assert "--enable-lora" in answer["error_message"]  # type: ignore[index]


class _Block(torch.nn.Module):
    """A layer whose linear sees the batch's tokens flattened (a MoE block's shared expert)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], 3)


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


def test_the_hook_adds_each_rows_adapter_also_to_flattened_tokens():
    """Rows [a1, base, a2] of a [3, 5, 4] batch through a linear that sees [15, 4]: each row gets
    its own adapter's term (not the first rows of the flattened tokens); one adapter for every
    row (the generic runner, batch-of-one) gets it on every token."""
    from slime.engines.torch_engine.lora import ServedAdapters

    torch.manual_seed(0)
    model = _Toy()
    served = ServedAdapters(model)
    ab = {n: (torch.randn(2, 4), torch.randn(3, 2)) for n in ("a1", "a2")}
    for n, (a, b) in ab.items():
        served.load(
            n,
            {"r": 2, "lora_alpha": 4},
            {"layers.0.proj.lora_A.weight": a, "layers.0.proj.lora_B.weight": b},
            n,
        )
    x = torch.randn(3, 5, 4)
    with torch.no_grad():
        base = model(x)
        with served.rows([served.adapters["a1"], None, served.adapters["a2"]]):
            mixed = model(x)
        with served.rows([served.adapters["a2"]]):
            alone = model(x[2:])
    for row, name in ((0, "a1"), (2, "a2")):
        a, b = ab[name]
        torch.testing.assert_close(mixed[row], base[row] + x[row] @ a.T @ b.T * 2.0)
    torch.testing.assert_close(mixed[1], base[1], rtol=0, atol=0)
    torch.testing.assert_close(alone[0], mixed[2])


def test_unload_waits_for_its_requests_and_refuses_new_ones(lora_engine, adapters):
    """As SGLang: once /unload_lora_adapter is called no new request may take the adapter, and it
    answers when the requests running with it have finished."""
    import threading
    import time

    status, _ = post(
        lora_engine.url, "/load_lora_adapter", {"lora_name": "busy", "lora_path": adapters["a2"]}
    )
    assert status == 200
    answers: dict[str, tuple[int, object]] = {}

    def long_request() -> None:
        answers["long"] = post(
            lora_engine.url,
            "/generate",
            {
                "input_ids": PROMPTS[0],
                "lora_path": "busy",
                "sampling_params": {"max_new_tokens": 1200, "temperature": 0.0, "ignore_eos": True},
            },
        )
        times["long"] = time.perf_counter()

    def unload() -> None:
        answers["unload"] = post(lora_engine.url, "/unload_lora_adapter", {"lora_name": "busy"})
        times["unload"] = time.perf_counter()

    times: dict[str, float] = {}
    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(0.3)  # the long request is running
    unloader = threading.Thread(target=unload)
    unloader.start()
    time.sleep(0.2)
    status, refused = post(lora_engine.url, "/generate", {"input_ids": [1, 2], "lora_path": "busy"})
    times["refused"] = time.perf_counter()
    assert status == 400 and "'busy' is not loaded" in refused["message"]  # type: ignore[index]
    worker.join()
    unloader.join()
    assert answers["long"][0] == 200
    status, answer = answers["unload"]
    assert status == 200 and "busy" not in answer["loaded_adapters"]  # type: ignore[index]
    # the refusal came while the long request still ran, and the unload answered after it
    assert times["refused"] < times["long"] <= times["unload"] + 0.05
