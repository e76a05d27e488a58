"""Faults and races the HTTP server must survive, against an in-process engine on loopback.

Each test reaches inside the engine (a failing callback, a dying thread, a command held on the
engine thread) and checks what a client sees over real HTTP.
"""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest
from tokenizers import Tokenizer, processors

from slime.engines.client import ClientConfig, EngineClient, EngineError
from slime.engines.protocol import GenerateRequest, ProtocolError
from slime.engines.torch_engine.sequence import Sequence
from slime.utils.sampling_params import SamplingParams
from tests.conftest import make_model
from tests.inprocess import InProcessServer

# Only reached when a fix regresses and a request would otherwise hang.
PATIENT = ClientConfig(timeout_s=60)
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def served(tiny_model):
    with InProcessServer(tiny_model) as server:
        yield server


async def _state(c: EngineClient) -> dict:
    return (await c.get_server_info())["internal_states"][0]


async def _until(predicate, c: EngineClient) -> None:
    for _ in range(2000):
        if predicate(await _state(c)):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the engine never reached the expected state")


def _request(rid: str, max_new_tokens: int) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid=rid, input_ids=(1, 2, 3), text=None, sampling_params=params)


def test_a_failing_finish_callback_spares_the_rest_of_the_batch(served):
    def broken(seq: Sequence) -> None:
        raise RuntimeError("callback bug")

    async def scenario():
        async with EngineClient(served.url, PATIENT) as c:
            reference = (await c.generate([1, 2, 3], sampling_params=GREEDY))["output_ids"]
            await c.pause_generation()
            bad = served.engine.make_sequence(_request("bad", 1), broken)
            await asyncio.wrap_future(served.engine.add([bad]))
            good = asyncio.create_task(c.generate([1, 2, 3], sampling_params=GREEDY))
            await _until(lambda s: s["num_waiting_reqs"] == 2, c)
            await c.continue_generation()  # both are prefilled in one step; "bad" ends first
            return reference, await good, await c.generate([1, 2, 3], sampling_params=GREEDY)

    reference, good, after = run(scenario())
    assert good["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert good["output_ids"] == reference == after["output_ids"]


def test_a_failing_release_resets_the_runner_and_serving_goes_on(served, monkeypatch):
    runner = served.engine.runner
    real_release = runner.release

    def release_once_broken(seq: Sequence) -> None:
        monkeypatch.setattr(runner, "release", real_release)
        raise RuntimeError("release bug")

    async def scenario():
        async with EngineClient(served.url, PATIENT) as c:
            reference = (await c.generate([1, 2, 3], sampling_params=GREEDY))["output_ids"]
            monkeypatch.setattr(runner, "release", release_once_broken)
            first = await c.generate([1, 2, 3], sampling_params=GREEDY)
            return reference, first, await c.generate([1, 2, 3], sampling_params=GREEDY)

    reference, first, after = run(scenario())
    assert first["output_ids"] == reference and after["output_ids"] == reference
    assert not runner.active


class _Fatal(BaseException):
    """Escapes the step's `except Exception`, as nothing should, to kill the engine thread."""


def test_a_dead_engine_thread_fails_requests_and_health_with_503(served, monkeypatch):
    def fatal_step() -> None:
        raise _Fatal("simulated fatal error")

    async def scenario():
        async with EngineClient(served.url, PATIENT) as c:
            await c.pause_generation()
            waiting = asyncio.create_task(c.generate([1, 2, 3], sampling_params=GREEDY))
            await _until(lambda s: s["num_waiting_reqs"] == 1, c)
            monkeypatch.setattr(served.engine, "_step", fatal_step)
            await c.continue_generation()
            errors = []
            with pytest.raises(EngineError) as info:
                await waiting
            errors.append(info.value)
            for path in ("/health", "/health_generate"):
                with pytest.raises(EngineError) as info:
                    await c.request("GET", path)
                errors.append(info.value)
            with pytest.raises(EngineError) as info:
                await c.generate([1, 2, 3], sampling_params=GREEDY)
            errors.append(info.value)
            return errors

    for error in run(scenario()):
        assert error.status == 503 and "_Fatal: simulated fatal error" in error.message
    assert served.engine.dead_reason is not None


def test_client_disconnect_while_its_add_runs_aborts_the_request(served, monkeypatch):
    engine = served.engine
    entered, release = threading.Event(), threading.Event()
    real_check = engine.check_available

    def held_check() -> None:  # runs on the engine thread, inside the add command
        entered.set()
        release.wait()
        real_check()

    async def scenario():
        async with EngineClient(served.url, PATIENT) as c:
            before = (await _state(c))["num_generated_tokens"]
            monkeypatch.setattr(engine, "check_available", held_check)
            async with aiohttp.ClientSession() as session:
                body = {
                    "input_ids": [1, 2, 3],
                    "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
                }
                post = asyncio.create_task(session.post(f"{served.url}/generate", json=body))
                await asyncio.to_thread(entered.wait)
                post.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await post
            # The server sees the disconnect and queues an abort behind the running add.
            for _ in range(2000):
                if not engine._commands.empty():
                    break
                await asyncio.sleep(0.005)
            release.set()
            await _until(lambda s: s["num_running_reqs"] == s["num_waiting_reqs"] == 0, c)
            return (await _state(c))["num_generated_tokens"] - before

    try:
        assert run(scenario()) == 0, "the request ran although its client had gone"
    finally:
        release.set()


def test_a_rid_in_flight_is_refused_and_free_again_after(served):
    async def scenario():
        async with EngineClient(served.url, PATIENT) as c:
            await c.pause_generation()
            first = asyncio.create_task(c.generate([1, 2], sampling_params=GREEDY, rid="dup"))
            await _until(lambda s: s["num_waiting_reqs"] == 1, c)
            with pytest.raises(EngineError) as info:
                await c.generate([3, 4], sampling_params={"max_new_tokens": 2}, rid="dup")
            await c.continue_generation()
            done = await first
            again = await c.generate([3, 4], sampling_params={"max_new_tokens": 2}, rid="dup")
            return info.value, done, again

    refused, done, again = run(scenario())
    assert refused.status == 400 and "'rid'" in refused.message and "dup" in refused.message
    assert done["meta_info"]["finish_reason"]["type"] == "length"
    assert again["meta_info"]["id"] == "dup"


def test_aborted_completion_reports_abort(served):
    async def scenario():
        async with EngineClient(served.url, PATIENT) as c:
            await c.pause_generation()
            task = asyncio.create_task(c.completions(prompt=[1, 2, 3], max_tokens=50, temperature=0))
            await _until(lambda s: s["num_waiting_reqs"] == 1, c)
            await c.abort_request(abort_all=True)
            await c.continue_generation()
            return await task

    assert run(scenario())["choices"][0]["finish_reason"] == "abort"


def test_tokenizer_work_stays_off_the_event_loop(served, monkeypatch):
    engine = served.engine
    threads: list[threading.Thread] = []
    real_encode, real_decode = engine.tokens.encode, engine.tokens.decode

    def encode(text: str) -> list[int]:
        threads.append(threading.current_thread())
        return real_encode(text)

    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        threads.append(threading.current_thread())
        return real_decode(ids, skip_special_tokens)

    monkeypatch.setattr(engine.tokens, "encode", encode)
    monkeypatch.setattr(engine.tokens, "decode", decode)

    async def scenario():
        async with EngineClient(served.url, PATIENT) as c:
            await c.generate(text="12+7=" * 200, sampling_params={"max_new_tokens": 2})
            await c.completions(prompt="hello", max_tokens=2, logprobs=1)

    run(scenario())
    assert threads and served.loop_thread not in threads


def test_empty_input_ids_refused_by_make_sequence(served):
    with pytest.raises(ProtocolError) as info:
        served.engine.make_sequence(
            GenerateRequest(rid="e", input_ids=(), text=None, sampling_params=SamplingParams()),
            lambda seq: None,
        )
    assert info.value.status == 400 and "input_ids" in info.value.message


def test_top_logprobs_limit_is_a_flag(tiny_model):
    with InProcessServer(tiny_model, max_top_logprobs_num=2) as server:

        async def scenario():
            async with EngineClient(server.url, PATIENT) as c:
                ok = await c.generate(
                    [1, 2], sampling_params={"max_new_tokens": 2}, return_logprob=True, top_logprobs_num=2
                )
                errors = []
                for call in (
                    c.generate([1, 2], return_logprob=True, top_logprobs_num=3),
                    c.completions(prompt=[1, 2], max_tokens=2, logprobs=3),
                ):
                    with pytest.raises(EngineError) as info:
                        await call
                    errors.append(info.value)
                return ok, errors

        ok, (too_many, too_many_openai) = run(scenario())
    assert all(len(top) == 2 for top in ok["meta_info"]["output_top_logprobs"])
    assert too_many.status == 400 and "'top_logprobs_num' 3" in too_many.message
    assert too_many_openai.status == 400 and "'logprobs' 3" in too_many_openai.message


def test_text_prompts_get_the_tokenizers_special_tokens(tmp_path):
    """As SGLang's tokenizer manager: text is encoded with add_special_tokens left on (BOS)."""
    model = make_model(str(tmp_path / "bos-model"))
    tokenizer = Tokenizer.from_file(f"{model}/tokenizer.json")
    bos = "<|endoftext|>"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
    )
    tokenizer.save(f"{model}/tokenizer.json")
    with InProcessServer(model) as server:

        async def scenario():
            async with EngineClient(server.url, PATIENT) as c:
                return await c.generate(text="abc", sampling_params={"max_new_tokens": 1})

        result = run(scenario())
    assert result["meta_info"]["prompt_tokens"] == 4  # BOS + one token per character
