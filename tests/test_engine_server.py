"""The torch engine over real HTTP on loopback: protocol, numerics, scheduling, control, bad input."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import torch

from slime.engines.client import EngineClient, EngineError


def run(coro):
    return asyncio.run(coro)


async def _gen(url, **kw):
    async with EngineClient(url) as c:
        return await c.generate(**kw)


def _body(raw: bytes) -> dict:
    try:
        return json.loads(raw or b"{}")
    except json.JSONDecodeError:
        return {"text": raw.decode()}


def raw_post(url: str, path: str, body: bytes | str, headers: dict | None = None) -> tuple[int, dict]:
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(url + path, data=data, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, _body(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, _body(e.read())


def raw_get(url: str, path: str, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url + path, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def teacher_forced_logprobs(model, prompt_ids, output_ids, temperature):
    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    logprobs = torch.log_softmax(logits / t, dim=-1)
    P = len(prompt_ids)
    return torch.stack([logprobs[P - 1 + i, tok] for i, tok in enumerate(output_ids)])


def test_generate_response_shape(engine, tokenizer):
    res = run(
        _gen(
            engine.url,
            text="What is 2+3?",
            sampling_params={"max_new_tokens": 5, "temperature": 0},
            return_logprob=True,
        )
    )
    assert set(res) >= {"text", "output_ids", "meta_info"}
    meta = res["meta_info"]
    assert (
        meta["finish_reason"] in ({"type": "length", "length": 5},) or meta["finish_reason"]["type"] == "stop"
    )
    assert meta["prompt_tokens"] == len(tokenizer.encode("What is 2+3?", add_special_tokens=False))
    assert meta["completion_tokens"] == len(res["output_ids"])
    assert isinstance(meta["weight_version"], str)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == res["output_ids"]
    assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, -1), (0.7, 0.9, 20), (0.0, 1.0, -1)])
def test_logprobs_match_teacher_forced_forward(engine, hf_model, temperature, top_p, top_k):
    prompts = [[5 + i, 17, 30 + i, 44, 9, 60 - i] * (1 + i) for i in range(4)]
    sp = {
        "max_new_tokens": 24,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "ignore_eos": True,
    }
    results = run(_gen(engine.url, input_ids=prompts, sampling_params=sp, return_logprob=True))
    for prompt, res in zip(prompts, results, strict=True):
        engine_lp = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        ref = teacher_forced_logprobs(hf_model, prompt, res["output_ids"], temperature)
        assert (engine_lp - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_input_logprobs_score_a_sequence_without_generating(engine, hf_model, tokenizer, temperature):
    """slime's OPD teacher request: input_ids, max_new_tokens 0, return_logprob, logprob_start_len.
    SGLang's layout: the first entry (the start position) is None, every later input token gets
    log softmax(logits / T) of a teacher-forced forward; nothing is generated; a batch of unequal
    lengths pads correctly."""
    seqs = [[5, 17, 30, 44, 9, 60, 11, 12], [7, 8, 9], [3] * 20 + [99, 100]]
    starts = [0, 1, 15]
    body = {
        "input_ids": seqs,
        "return_logprob": True,
        "logprob_start_len": starts,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 0, "temperature": temperature, "skip_special_tokens": False},
    }
    status, results = raw_post(engine.url, "/generate", json.dumps(body))
    assert status == 200, results
    for ids, start, res in zip(seqs, starts, results, strict=True):
        assert res["output_ids"] == [] and res["meta_info"]["completion_tokens"] == 0
        entries = res["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in entries] == ids[start:]
        assert [text for _, _, text in entries] == [tokenizer.decode([t]) for t in ids[start:]]
        first = start + 1
        assert entries[0][0] is None
        got = torch.tensor([lp for lp, _, _ in entries[1:]])
        ref = teacher_forced_logprobs(hf_model, ids[:first], ids[first:], temperature)
        assert (got - ref).abs().max().item() < 1e-5
    status, err = raw_post(
        engine.url, "/generate", json.dumps({**body, "input_ids": [1, 2], "logprob_start_len": 2})
    )
    assert status == 400 and "'logprob_start_len' 2 must be below the input's length (2 tokens)" in str(err)


def test_greedy_equals_hf_generate(engine, hf_model, tokenizer):
    prompts = ["12+7=", "hello world", "<|im_start|>user\nabc<|im_end|>\n"]
    results = run(
        _gen(
            engine.url,
            text=prompts,
            sampling_params={"max_new_tokens": 20, "temperature": 0, "ignore_eos": True},
        )
    )
    for prompt, res in zip(prompts, results, strict=True):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert res["output_ids"] == out[0, len(ids) :].tolist()


def test_continuous_batching_joins_running_batch(engine):
    async def scenario():
        async with EngineClient(engine.url) as c:
            before = (await c.get_server_info())["internal_states"][0]["num_steps"]
            long_task = asyncio.create_task(
                c.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 400, "ignore_eos": True})
            )
            while (await c.get_server_info())["internal_states"][0]["num_running_reqs"] < 1:
                await asyncio.sleep(0.005)
            short = await c.generate(
                input_ids=[7, 8, 9, 10, 11], sampling_params={"max_new_tokens": 50, "ignore_eos": True}
            )
            assert not long_task.done(), "the short request should finish while the long one decodes"
            long = await long_task
            after = (await c.get_server_info())["internal_states"][0]["num_steps"]
            return before, after, short, long

    before, after, short, long = run(scenario())
    assert short["meta_info"]["completion_tokens"] == 50
    assert long["meta_info"]["completion_tokens"] == 400
    # Sequential service would take 400 + 50 steps; joining the batch shares the decode steps.
    assert after - before <= 400 + 2


def test_stop_strings_tokens_and_eos(engine, tokenizer):
    base = run(
        _gen(
            engine.url,
            input_ids=[20, 21, 22],
            sampling_params={"max_new_tokens": 30, "temperature": 0, "ignore_eos": True},
        )
    )
    ids = base["output_ids"]
    # stop at a token that greedy decoding produces at position 5
    stop_tok = ids[5]
    first = ids.index(stop_tok)
    res = run(
        _gen(
            engine.url,
            input_ids=[20, 21, 22],
            sampling_params={
                "max_new_tokens": 30,
                "temperature": 0,
                "ignore_eos": True,
                "stop_token_ids": [stop_tok],
            },
        )
    )
    assert res["output_ids"] == ids[: first + 1]
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    # a stop string: the text is cut before it
    text = tokenizer.decode(ids)
    stop_str = text[8:10]
    cut = text.find(stop_str)
    res = run(
        _gen(
            engine.url,
            input_ids=[20, 21, 22],
            sampling_params={"max_new_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": [stop_str]},
        )
    )
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
    assert res["text"] == text[:cut]
    res = run(
        _gen(
            engine.url,
            input_ids=[20, 21, 22],
            sampling_params={
                "max_new_tokens": 30,
                "temperature": 0,
                "ignore_eos": True,
                "stop": [stop_str],
                "no_stop_trim": True,
            },
        )
    )
    assert res["text"].endswith(stop_str)
    # max_new_tokens 0 finishes at once
    res = run(_gen(engine.url, input_ids=[20, 21], sampling_params={"max_new_tokens": 0}))
    assert res["output_ids"] == [] and res["meta_info"]["finish_reason"]["type"] == "length"


def test_eos_ends_generation_unless_ignored(engine, tokenizer):
    eos = tokenizer.eos_token_id
    res = run(
        _gen(
            engine.url,
            input_ids=[[30, 31]] * 8,
            sampling_params={"max_new_tokens": 200, "temperature": 1.5, "sampling_seed": 3},
        )
    )
    for r in res:
        if r["meta_info"]["finish_reason"]["type"] == "stop":
            assert r["output_ids"][-1] == r["meta_info"]["finish_reason"]["matched"]
            assert r["output_ids"][-1] in (eos, tokenizer.pad_token_id)
        else:
            assert eos not in r["output_ids"]


def test_sampling_seed_reproducible(engine):
    sp = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 1234, "ignore_eos": True}
    a = run(_gen(engine.url, input_ids=[1, 2, 3, 4], sampling_params=sp))
    b = run(_gen(engine.url, input_ids=[1, 2, 3, 4], sampling_params=sp))
    c = run(_gen(engine.url, input_ids=[1, 2, 3, 4], sampling_params={**sp, "sampling_seed": 99}))
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


def test_abort_one_and_all(engine):
    async def scenario():
        async with EngineClient(engine.url) as c:
            sp = {"max_new_tokens": 1500, "ignore_eos": True}
            t1 = asyncio.create_task(
                c.generate(input_ids=[1, 2], sampling_params=sp, rid="victim", return_logprob=True)
            )
            t2 = asyncio.create_task(c.generate(input_ids=[3, 4], sampling_params=sp, rid="other"))
            while (await c.get_server_info())["internal_states"][0]["num_running_reqs"] < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert (await c.abort_request("victim"))["num_aborted"] == 1
            victim = await t1
            assert not t2.done()
            await c.abort_request(abort_all=True)
            other = await t2
            return victim, other

    victim, other = run(scenario())
    for res in (victim, other):
        assert res["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(res["output_ids"]) < 1500
    assert len(victim["meta_info"]["output_token_logprobs"]) == len(victim["output_ids"])


def test_pause_and_continue(engine):
    async def scenario():
        async with EngineClient(engine.url) as c:
            await c.pause_generation()
            steps = (await c.get_server_info())["internal_states"][0]["num_steps"]
            task = asyncio.create_task(c.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 8}))
            await asyncio.sleep(0.5)
            info = (await c.get_server_info())["internal_states"][0]
            assert not task.done() and info["num_steps"] == steps and info["paused"]
            await c.continue_generation()
            return await asyncio.wait_for(task, 60)

    res = run(scenario())
    assert res["meta_info"]["completion_tokens"] >= 1


def test_info_endpoints(engine, tiny_model):
    assert raw_get(engine.url, "/health")[0] == 200
    assert raw_get(engine.url, "/health_generate")[0] == 200
    for path in ("/get_model_info", "/model_info"):
        status, body = raw_get(engine.url, path)
        assert status == 200 and json.loads(body)["model_path"] == tiny_model
    for path in ("/get_server_info", "/server_info"):
        status, body = raw_get(engine.url, path)
        assert status == 200 and json.loads(body)["context_length"] == 2048
    status, body = raw_get(engine.url, "/get_weight_version")
    assert status == 200 and "weight_version" in json.loads(body)
    status, _ = raw_post(engine.url, "/flush_cache", "")
    assert status == 200


def test_openai_completions(engine):
    status, body = raw_post(
        engine.url,
        "/v1/completions",
        json.dumps(
            {
                "model": "tiny",
                "prompt": ["1+1=", "2+2="],
                "max_tokens": 6,
                "temperature": 0.8,
                "n": 2,
                "logprobs": 2,
                "seed": 7,
                "stop": ["\n"],
            }
        ),
        {"Content-Type": "application/json"},
    )
    assert status == 200, body
    assert body["object"] == "text_completion" and len(body["choices"]) == 4
    for ch in body["choices"]:
        assert ch["finish_reason"] in ("stop", "length")
        lp = ch["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
        assert all(len(t) <= 2 for t in lp["top_logprobs"])
    assert body["usage"]["prompt_tokens"] == 8
    assert body["usage"]["total_tokens"] == 8 + body["usage"]["completion_tokens"]


BAD_REQUESTS = [
    ("/generate", "{not json", "malformed JSON"),
    ("/generate", "[1, 2]", "JSON object"),
    (
        "/generate",
        json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}),
        "max_new_tokens",
    ),
    (
        "/generate",
        json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**12}}),
        "context length",
    ),
    ("/generate", json.dumps({"input_ids": [1, 2], "sampling_params": {"temperature": -0.5}}), "temperature"),
    ("/generate", json.dumps({"input_ids": [1, 10**6]}), "outside the vocabulary"),
    ("/generate", json.dumps({"input_ids": [-3]}), "outside the vocabulary"),
    ("/generate", json.dumps({"input_ids": [1] * 5000}), "longer than the model's context length"),
    ("/generate", json.dumps({"text": "a", "input_ids": [1]}), "exactly one"),
    ("/generate", json.dumps({"input_ids": [1], "sampling_params": {"top_p": 0}}), "top_p"),
    ("/generate", json.dumps({"input_ids": [1], "sampling_params": {"bogus": 1}}), "bogus"),
    ("/update_weights_from_disk", json.dumps({"model_path": "/nonexistent"}), "not a directory"),
    (
        "/update_weights_from_distributed",
        json.dumps({"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"}),
        "no weight-update group",
    ),
    ("/update_weights_from_tensor", json.dumps({"serialized_named_tensors": ["garbage"]}), "handle"),
    ("/abort_request", json.dumps({}), "rid"),
    ("/pause_generation", json.dumps({"mode": "sideways"}), "mode"),
    ("/release_memory_occupation", json.dumps({"tags": ["gpu"]}), "tags"),
    ("/v1/completions", json.dumps({"max_tokens": 3}), "prompt"),
    # Inner prompt lists must be non-empty integer token ids inside the vocabulary: an empty
    # prefill used to crash the engine step and abort every request in flight.
    ("/v1/completions", json.dumps({"prompt": [[]], "max_tokens": 2}), "prompt"),
    ("/v1/completions", json.dumps({"prompt": [[1.5]], "max_tokens": 2}), "prompt"),
    ("/v1/completions", json.dumps({"prompt": [["a"]], "max_tokens": 2}), "prompt"),
    ("/v1/completions", json.dumps({"prompt": [[True]], "max_tokens": 2}), "prompt"),
    ("/v1/completions", json.dumps({"prompt": [1, True], "max_tokens": 2}), "prompt"),
    ("/v1/completions", json.dumps({"prompt": [[1, 10**6]], "max_tokens": 2}), "outside the vocabulary"),
    ("/v1/completions", json.dumps({"prompt": "a", "seed": -1}), "seed"),
    (
        "/generate",
        json.dumps({"input_ids": [1], "return_logprob": True, "top_logprobs_num": 21}),
        "top_logprobs_num",
    ),
    ("/generate", json.dumps({"input_ids": [[]]}), "input_ids"),
    ("/generate", json.dumps({"input_ids": [[1.5]]}), "input_ids"),
    ("/generate", json.dumps({"input_ids": [[True, 2]]}), "input_ids"),
    (
        "/generate",
        json.dumps({"input_ids": [1], "sampling_params": {"sampling_seed": 2**64}}),
        "sampling_seed",
    ),
    ("/generate", json.dumps({"input_ids": [1], "sampling_params": {"seed": -5}}), "sampling_seed"),
]


@pytest.mark.parametrize("path,body,needle", BAD_REQUESTS)
def test_bad_input_is_a_4xx_naming_the_problem(engine, path, body, needle):
    status, payload = raw_post(engine.url, path, body, {"Content-Type": "application/json"})
    assert 400 <= status < 500, (status, payload)
    assert needle in payload["message"], payload
    ok = run(_gen(engine.url, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2}))
    assert ok["meta_info"]["completion_tokens"] >= 1


def test_unknown_endpoint_is_json_404(engine):
    status, body = raw_get(engine.url, "/no_such_endpoint")
    assert status == 404 and json.loads(body)["code"] == 404


def test_client_maps_errors(engine):
    with pytest.raises(EngineError) as info:
        run(_gen(engine.url, input_ids=[1], sampling_params={"temperature": -1}))
    assert info.value.status == 400 and "temperature" in info.value.message


def test_client_disconnect_aborts_the_request(engine):
    from slime.engines.client import ClientConfig

    async def scenario():
        async with EngineClient(engine.url) as c:
            before = (await c.get_server_info())["internal_states"][0]["num_generated_tokens"]
        async with EngineClient(engine.url, ClientConfig(timeout_s=0.5)) as impatient:
            with pytest.raises(EngineError, match="timed out"):
                await impatient.generate(
                    [1, 2, 3], sampling_params={"max_new_tokens": 1900, "ignore_eos": True}
                )
        async with EngineClient(engine.url) as c:
            for _ in range(100):
                state = (await c.get_server_info())["internal_states"][0]
                if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
                    return state["num_generated_tokens"] - before
                await asyncio.sleep(0.05)
        return None

    generated = run(scenario())
    assert generated is not None and generated < 1900, "the request kept running after its client went away"
