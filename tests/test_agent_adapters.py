"""The agent adapters against a real torch engine, driven by the `openai` and `anthropic` Python
clients over loopback: token exactness (every trained token is one the engine produced after
exactly the tokens before it, its log-prob the engine's, checked against a teacher-forced HF
forward), token reuse vs re-rendering (drift), streaming, bad input, 64 sessions at once, a hung
turn and an engine restarted under a live session."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import aiohttp
import pytest

from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.utils.async_utils import run_sync
from slime.utils.sample import Sample
from tests.conftest import start_engine
from tests.test_engine_server import teacher_forced_logprobs

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

SAMPLING = {"temperature": 1.0, "max_new_tokens": 12}


class Served:
    """An adapter served from its own thread, with the turns it recorded."""

    def __init__(self, adapter):
        self.adapter = adapter
        self._turns, self._by_sid = [], {}

        def record(sid, msgs, tools, reply, turn):
            self._turns.append(turn)
            self._by_sid.setdefault(sid, []).append(turn)

        adapter.debug_callback = record
        self.handle = run_app_in_thread(adapter.app)
        self.url = self.handle.url

    def _settled(self):
        """The answer is sent before the turn is recorded: wait for the recording to end."""
        deadline = time.monotonic() + 10
        while any(self.adapter.inflight.values()) and time.monotonic() < deadline:
            time.sleep(0.005)

    @property
    def turns(self):
        self._settled()
        return self._turns

    @property
    def by_sid(self):
        self._settled()
        return self._by_sid

    def finish(self, sid, reward=1.0, **kw):
        return run_sync(
            self.adapter.finish_session(sid, base_sample=Sample(index=0, prompt="p"), reward=reward, **kw)
        )

    def close(self):
        self.handle.stop()


@pytest.fixture
def served(engine, tokenizer):
    made = []

    def make(cls=OpenAIAdapter, **kw):
        s = Served(cls(tokenizer=tokenizer, sglang_url=engine.url, **kw))
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def check_exact(sample, turns, hf_model):
    """Every trained span is a recorded turn's output after exactly its prompt, and its log-probs
    are the engine's and a teacher-forced forward's."""
    start = len(sample.tokens) - sample.response_length
    mask = [0] * start + list(sample.loss_mask) + [0]
    spans, begin = [], None
    for i, m in enumerate(mask):
        if m and begin is None:
            begin = i
        elif not m and begin is not None:
            spans.append((begin, i))
            begin = None
    assert spans, "nothing trained"
    for a, b in spans:
        (turn,) = [
            t for t in turns if t.prompt_ids == sample.tokens[:a] and t.output_ids == sample.tokens[a:b]
        ]
        got = sample.rollout_log_probs[a - start : b - start]
        assert got == turn.output_log_probs
        assert (
            max(
                abs(x - y)
                for x, y in zip(
                    got,
                    teacher_forced_logprobs(hf_model, sample.tokens[:a], sample.tokens[a:b], 1.0).tolist(),
                )
            )
            < 1e-5
        )
    return spans


def chat(url, sid, messages, **kw):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=sid, max_retries=0)
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


def test_an_openai_agent_that_appends_trains_on_exactly_the_engines_tokens(served, hf_model):
    s = served(tool_parser="qwen25")
    s.adapter.open_session("s1", sampling_defaults=SAMPLING)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}]
    for k in range(3):
        reply = chat(s.url, "s1", messages, max_tokens=8)
        choice = reply.choices[0]
        assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens == len(s.turns[-1].output_ids) <= 8
        assert reply.usage.prompt_tokens == len(s.turns[-1].prompt_ids)
        messages += [
            {"role": "assistant", "content": choice.message.content or ""},
            {"role": "user", "content": f"again {k}"},
        ]
    # Each turn's prompt is the previous prompt + the model's own output + the new messages.
    for before, after in zip(s.turns, s.turns[1:]):
        assert (
            after.prompt_ids[: len(before.prompt_ids) + len(before.output_ids)]
            == before.prompt_ids + before.output_ids
        )
    (sample,) = s.finish("s1", reward=0.5)
    assert len(check_exact(sample, s.turns, hf_model)) == 3
    assert sample.reward == 0.5 and sample.metadata["rendered_in_full"] == 0
    assert sample.metadata["forked_turns"] == 0 and sample.metadata["realigned_turns"] == 0
    assert sample.weight_versions and sample.response == s.adapter.tokenizer.decode(
        sample.tokens[-sample.response_length :], skip_special_tokens=False
    )


def test_a_traced_sessions_turns_are_sglang_generate_spans_in_the_samples_trace(served):
    from slime.observability.trace_utils import trace_span

    s = served()
    base = Sample(index=3, prompt="p")
    with trace_span(base, "generate_and_rm") as rollout_span:  # where a rollout opens the session
        s.adapter.open_session("tr", sampling_defaults=SAMPLING, trace=base)
    messages = [{"role": "user", "content": "1+1="}]
    for _ in range(2):
        reply = chat(s.url, "tr", messages, max_tokens=4)
        answer = {"role": "assistant", "content": reply.choices[0].message.content or ""}
        messages += [answer, {"role": "user", "content": "and?"}]
    (sample,) = run_sync(s.adapter.finish_session("tr", base_sample=base))
    assert sample.trace is base.trace  # the execution's trace, with its turns
    events = [e for e in sample.trace["events"] if e["name"] == "sglang_generate"]
    starts, ends = events[::2], events[1::2]
    assert [e["type"] for e in events] == ["span_start", "span_end"] * 2
    assert all(e["parent_span_id"] == rollout_span.span_records[0][1] for e in starts)
    for end, turn in zip(ends, s.turns):
        assert end["attrs"]["completion_tokens"] == len(turn.output_ids) and end["attrs"]["e2e_latency"] > 0
        assert end["attrs"]["prompt_tokens"] == len(turn.prompt_ids) and "queue_time" in end["attrs"]


def test_an_anthropic_agent_streams_and_is_recorded_the_same_way(served, hf_model):
    s = served(AnthropicAdapter)
    s.adapter.open_session("a1", sampling_defaults=SAMPLING)
    client = anthropic.Anthropic(base_url=s.url, api_key="a1", max_retries=0)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    texts = []
    for k in range(2):
        with client.messages.stream(model="tiny", max_tokens=8, system="sys", messages=messages) as stream:
            final = stream.get_final_message()
        assert final.usage.output_tokens == len(s.turns[-1].output_ids)
        text = "".join(b.text for b in final.content if b.type == "text")
        texts.append(text)
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": text}]},
            {"role": "user", "content": f"more {k}"},
        ]
    count = client.messages.count_tokens(model="tiny", messages=messages, system="sys")
    assert count.input_tokens > len(s.turns[-1].prompt_ids)
    (sample,) = s.finish("a1")
    assert len(check_exact(sample, s.turns, hf_model)) == 2 and sample.metadata["rendered_in_full"] == 0


UPPER_HISTORY = (  # a template that writes earlier replies in capitals: a re-render always drifts
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + (m.content | upper if m.role == 'assistant' "
    "else m.content) + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


@pytest.mark.parametrize("reuse", [True, False])
def test_reusing_held_tokens_avoids_the_drift_a_re_rendering_template_causes(
    served, hf_model, tokenizer, reuse
):
    s = served(reuse_tokens=reuse, fork_threshold_tokens=1024)
    s.adapter.history.chat_template_kwargs = {"chat_template": UPPER_HISTORY}
    s.adapter.open_session("d", sampling_defaults={**SAMPLING, "sampling_seed": 7})
    messages = [{"role": "user", "content": "x"}]
    reply = chat(s.url, "d", messages, max_tokens=12).choices[0].message.content or ""
    assert reply != reply.upper(), "precondition: the seeded reply has lower-case letters"
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "y"}]
    chat(s.url, "d", messages, max_tokens=4)
    (sample,) = s.finish("d")
    spans = check_exact(sample, s.turns, hf_model)
    if reuse:  # the model's own tokens, and both replies train
        assert len(spans) == 2 and sample.metadata["rendered_in_full"] == 0
        assert sample.metadata["realigned_turns"] == 0
    else:  # the capitals replace the first reply's tokens, which no longer train
        assert len(spans) == 1 and sample.metadata["rendered_in_full"] == 1
        assert sample.metadata["realigned_turns"] == 1


def test_a_rewritten_reply_is_not_trained_twice(served, hf_model):
    s = served()
    s.adapter.open_session("w", sampling_defaults=SAMPLING)
    reply = (
        chat(s.url, "w", [{"role": "user", "content": "x"}], max_tokens=6).choices[0].message.content or ""
    )
    chat(
        s.url,
        "w",
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": reply + " (edited)"},
            {"role": "user", "content": "y"},
        ],
        max_tokens=4,
    )
    (sample,) = s.finish("w")
    assert len(check_exact(sample, s.turns, hf_model)) == 1  # only the second reply trains
    assert sample.metadata["rendered_in_full"] == 1


def test_bad_requests_get_a_4xx_naming_the_problem_and_leave_other_sessions_alone(served):
    s = served(max_turns_per_sid=1)
    s.adapter.open_session("ok", sampling_defaults=SAMPLING)
    s.adapter.open_session("capped", sampling_defaults=SAMPLING)

    async def post(body, sid, path="/v1/chat/completions"):
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{s.url}{path}", json=body, headers={"Authorization": f"Bearer {sid}"}) as r,
        ):
            return r.status, (await r.json()) if r.content_type == "application/json" else await r.text()

    def call(body, sid="ok", path="/v1/chat/completions"):
        return run_sync(post(body, sid, path))

    user = [{"role": "user", "content": "q"}]
    cases = [
        ({"messages": [{"role": "wizard", "content": "q"}]}, "ok", 400, "role 'wizard'"),
        ({"messages": "q"}, "ok", 400, "'messages' must be a list"),
        ({"messages": []}, "ok", 400, "at least one message"),
        ({"messages": user, "n": 2}, "ok", 400, "'n' must be 1"),
        (
            {"messages": [*user, {"role": "assistant", "tool_calls": [{"function": {}}]}]},
            "ok",
            400,
            "no function name",
        ),
        ({"messages": user, "max_tokens": -1}, "ok", 400, "'max_tokens' must be an integer >= 0"),
        ({"messages": user}, "stranger", 404, "no open session 'stranger'"),
    ]
    for body, sid, status, text in cases:
        got, answer = call(body, sid)
        assert got == status and text in answer["error"]["message"], (body, answer)
    assert call({"messages": user, "max_tokens": 2}, "capped")[0] == 200
    assert call({"messages": user, "max_tokens": 2}, "capped")[0] == 429
    status, answer = call({"messages": user, "max_tokens": 2})
    assert status == 200 and answer["choices"][0]["message"]["role"] == "assistant"
    (sample,) = s.finish("ok")
    assert sample.metadata["agent_turns"] == 1  # the refused requests recorded nothing
    status, answer = call({"messages": user}, "ok")
    assert status == 410 and "closed" in answer["error"]["message"]
    status, answer = call({"messages": [{"role": "wizard"}], "max_tokens": 1}, "ok", "/v1/messages")
    assert status == 404  # the OpenAI adapter has no Anthropic route


def test_64_sessions_at_once(served, hf_model):
    s = served()
    sids = [f"many-{i}" for i in range(64)]
    for sid in sids:
        s.adapter.open_session(sid, sampling_defaults={**SAMPLING, "max_new_tokens": 3})

    async def agent(client, sid):
        messages = [{"role": "user", "content": sid}]
        for _ in range(2):
            r = await client.chat.completions.create(
                model="tiny", messages=messages, extra_headers={"Authorization": f"Bearer {sid}"}
            )
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content or ""},
                {"role": "user", "content": "+"},
            ]

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0) as client:
            await asyncio.gather(*(agent(client, sid) for sid in sids))

    asyncio.run(main())
    for sid in sids:
        (sample,) = s.finish(sid)
        assert sid in s.adapter.tokenizer.decode(sample.tokens)  # its own conversation
        assert (
            len(check_exact(sample, s.by_sid[sid], hf_model)) == 2
            and sample.metadata["rendered_in_full"] == 0
        )
    assert len(s.turns) == 128


def test_a_session_finished_while_a_turn_hangs_records_only_whole_turns(served):
    s = served()
    s.adapter.open_session("h", sampling_defaults={**SAMPLING, "ignore_eos": True, "max_new_tokens": 1500})
    chat(s.url, "h", [{"role": "user", "content": "q"}], max_tokens=4)

    async def scenario():
        async def hanging():  # a long generation the session is finished under
            try:
                async with (
                    aiohttp.ClientSession() as http,
                    http.post(
                        f"{s.url}/v1/chat/completions",
                        headers={"Authorization": "Bearer h"},
                        json={"messages": [{"role": "user", "content": "z"}]},
                    ) as r,
                ):
                    return r.status
            except aiohttp.ClientError:  # the cancelled handler closed the connection
                return None

        task = asyncio.ensure_future(hanging())
        await asyncio.sleep(0.5)
        samples = await s.adapter.finish_session("h", base_sample=Sample(), reward=1.0, wait_timeout=0.2)
        return samples, await task

    samples, status = run_sync(scenario())
    assert len(samples) == 1 and samples[0].metadata["agent_turns"] == 1  # the hung turn is not recorded
    assert sum(samples[0].loss_mask) == len(s.turns[0].output_ids) and len(s.turns) == 1
    assert status != 200


def test_an_engine_restarted_under_a_live_session(tiny_model, tokenizer, tmp_path, hf_model):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = start_engine(tiny_model, tmp_path, "--port", str(port))
    s = Served(OpenAIAdapter(tokenizer=tokenizer, sglang_url=engine.url))
    try:
        s.adapter.open_session("r", sampling_defaults=SAMPLING)
        messages = [{"role": "user", "content": "q"}]
        first = chat(s.url, "r", messages, max_tokens=4).choices[0].message.content or ""
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "next"}]
        engine.stop()
        with pytest.raises(openai.APIStatusError) as e:  # the agent sees a 502 it may retry
            chat(s.url, "r", messages, max_tokens=4)
        assert e.value.status_code == 502 and "engine" in str(e.value)
        engine = start_engine(tiny_model, tmp_path, "--port", str(port))  # restarted where it was
        chat(s.url, "r", messages, max_tokens=4)
        (sample,) = s.finish("r")
        assert len(check_exact(sample, s.turns, hf_model)) == 2 and sample.metadata["agent_turns"] == 2
    finally:
        s.close()
        engine.stop()


def test_tool_calls_round_trip_in_both_protocols(tokenizer, tmp_path):
    """A reply with a Qwen/Hermes tool call, in each protocol's shape, and its echo reusing the
    held tokens. The model here cannot be steered to write a tool call, so the engine is a
    scripted SGLang-protocol server (the adapters' own code runs unchanged)."""
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call><|im_end|>'
    engine = ScriptedEngine(tokenizer, [call, "42<|im_end|>"] * 2)
    tools_openai = [
        {
            "type": "function",
            "function": {
                "name": "python",
                "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
            },
        }
    ]
    try:
        s = Served(OpenAIAdapter(tokenizer=tokenizer, sglang_url=engine.url, tool_parser="qwen25"))
        s.adapter.open_session("t")
        messages = [{"role": "user", "content": "6*7?"}]
        first = chat(s.url, "t", messages, tools=tools_openai).choices[0]
        (tc,) = first.message.tool_calls
        assert first.finish_reason == "tool_calls" and first.message.content is None
        assert tc.function.name == "python" and json.loads(tc.function.arguments) == {"code": "print(6*7)"}
        messages += [
            first.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tc.id, "content": "42"},
        ]
        assert chat(s.url, "t", messages, tools=tools_openai).choices[0].message.content == "42"
        (sample,) = s.finish("t")
        assert sample.metadata["use_tool"] and sample.metadata["rendered_in_full"] == 0
        assert sample.tokens == s.turns[1].prompt_ids + s.turns[1].output_ids
        assert "<|im_start|>tool\n42<|im_end|>" in tokenizer.decode(sample.tokens)
        s.close()

        s = Served(AnthropicAdapter(tokenizer=tokenizer, sglang_url=engine.url, tool_parser="hermes"))
        s.adapter.open_session("t")
        client = anthropic.Anthropic(base_url=s.url, api_key="t", max_retries=0)
        tools = [
            {"name": "python", "input_schema": {"type": "object", "properties": {"code": {"type": "string"}}}}
        ]
        msgs = [{"role": "user", "content": "6*7?"}]
        first = client.messages.create(model="m", max_tokens=64, messages=msgs, tools=tools)
        (use,) = [b for b in first.content if b.type == "tool_use"]
        assert first.stop_reason == "tool_use" and use.input == {"code": "print(6*7)"}
        msgs += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]},
        ]
        second = client.messages.create(model="m", max_tokens=64, messages=msgs, tools=tools)
        assert second.stop_reason == "end_turn" and second.content[0].text == "42"
        (sample,) = s.finish("t")
        assert sample.metadata["rendered_in_full"] == 0 and sum(sample.loss_mask) == sum(
            len(t.output_ids) for t in s.turns
        )
        s.close()
    finally:
        engine.close()


class ScriptedEngine:
    """An SGLang-protocol /generate that answers with scripted texts in turn (their token ids and
    log-probs of -0.5): for tests that need the model to write something it cannot be made to."""

    def __init__(self, tokenizer, texts):
        from aiohttp import web

        self.texts, self.tokenizer = list(texts), tokenizer
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        self.handle = run_app_in_thread(app)
        self.url = self.handle.url

    async def _generate(self, request):
        from aiohttp import web

        await request.json()
        ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False)
        return web.json_response(
            {
                "text": "",
                "output_ids": ids,
                "meta_info": {
                    "output_token_logprobs": [[-0.5, t, None] for t in ids],
                    "finish_reason": {"type": "stop"},
                    "weight_version": "3",
                },
            }
        )

    def close(self):
        self.handle.stop()


def test_unknown_parsers_are_refused_at_construction(tokenizer):
    if os.environ.get("SLIME_HAS_SGLANG"):
        pytest.skip("SGLang installed: its parsers are used")
    with pytest.raises(ValueError, match="tool-call parser 'llama4' is not built here"):
        OpenAIAdapter(tokenizer=tokenizer, sglang_url="http://127.0.0.1:1", tool_parser="llama4")


@pytest.mark.parametrize(
    "reply, closing",
    [
        ("hi<|im_end|>", "\n"),  # stopped on the template's end token
        (
            "hi<|endoftext|>",
            "<|im_end|>\n",
        ),  # stopped on another special token: the template's end follows it
        ("hi ", "<|im_end|>\n"),  # cut off by max_tokens, with whitespace the echo loses
    ],
)
def test_the_held_reply_is_closed_the_way_the_template_closes_a_turn(tokenizer, reply, closing):
    engine = ScriptedEngine(tokenizer, [reply, "ok<|im_end|>"])
    s = Served(OpenAIAdapter(tokenizer=tokenizer, sglang_url=engine.url))
    try:
        s.adapter.open_session("c")
        first = chat(s.url, "c", [{"role": "user", "content": "q"}]).choices[0].message.content
        assert first == "hi"
        chat(
            s.url,
            "c",
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": first},
                {"role": "user", "content": "r"},
            ],
        )
        t1, t2 = s.turns
        tail = tokenizer.decode(t2.prompt_ids[len(t1.prompt_ids) + len(t1.output_ids) :])
        assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
        assert tail == closing + "<|im_start|>user\nr<|im_end|>\n<|im_start|>assistant\n"
        (sample,) = s.finish("c")
        assert sample.metadata["rendered_in_full"] == 0 and sum(sample.loss_mask) == len(t1.output_ids) + 3
    finally:
        s.close()
        engine.close()


def test_openai_streaming_carries_the_tool_call_and_the_usage(tokenizer):
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call><|im_end|>'
    engine = ScriptedEngine(tokenizer, [call, "1<|im_end|>"])
    s = Served(OpenAIAdapter(tokenizer=tokenizer, sglang_url=engine.url, tool_parser="hermes"))
    tools = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]
    try:
        s.adapter.open_session("st")
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="st", max_retries=0)
        messages = [{"role": "user", "content": "1?"}]
        chunks = list(client.chat.completions.create(model="m", messages=messages, tools=tools, stream=True))
        (tc,) = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or [])]
        assert tc.function.name == "python" and json.loads(tc.function.arguments) == {"code": "print(1)"}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert chunks[-1].usage.completion_tokens == len(s.turns[0].output_ids)
        messages += [
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": tc.id,
                        "type": "function",
                        "function": {"name": "python", "arguments": tc.function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": tc.id, "content": "1"},
        ]
        stream = client.chat.completions.create(model="m", messages=messages, tools=tools, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == "1"
        (sample,) = s.finish("st")
        assert sample.metadata["rendered_in_full"] == 0 and sample.metadata["use_tool"]
    finally:
        s.close()
        engine.close()


def test_a_reply_that_kept_one_of_two_tool_calls_is_not_reused(tokenizer):
    """The OpenAI reply carries one tool call (slime's); the model's tokens said two, so the next
    turn is rendered from the recorded history, not continued from those tokens."""
    one = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    two = '<tool_call>{"name": "python", "arguments": {"code": "print(2)"}}</tool_call>'
    engine = ScriptedEngine(tokenizer, [one + two + "<|im_end|>", "1<|im_end|>"])
    s = Served(OpenAIAdapter(tokenizer=tokenizer, sglang_url=engine.url, tool_parser="hermes"))
    tools = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]
    try:
        s.adapter.open_session("two")
        messages = [{"role": "user", "content": "1?"}]
        first = chat(s.url, "two", messages, tools=tools).choices[0].message
        assert len(first.tool_calls) == 1
        messages += [
            first.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "1"},
        ]
        chat(s.url, "two", messages, tools=tools)
        t1, t2 = s.turns
        assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] != t1.prompt_ids + t1.output_ids
        assert two not in tokenizer.decode(t2.prompt_ids)
        (*_, last) = s.finish("two")
        assert last.metadata["rendered_in_full"] == 1
    finally:
        s.close()
        engine.close()
