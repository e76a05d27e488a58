"""The OpenAI Chat Completions adapter: POST /v1/chat/completions (messages, tools and
tool_calls, stop, max_tokens / max_completion_tokens, temperature, top_p, n=1, stream).

The session is the bearer token (an OpenAI client sends its API key as one), else the body's
metadata.session_id, else its user, else "default" (slime's order).

As slime does, the reply carries at most one tool call (some clients drop parallel calls when
they echo them), `content: null` beside a tool call, and arguments as a JSON string; the message
recorded for the trajectory has the arguments as a mapping, no call ids and no reasoning, which
is how the next request's echo of it compares equal.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any

from aiohttp import web

from slime.agent.adapters.common import BaseAdapter, Reply, sid_from_bearer, sid_from_body
from slime.agent.adapters.errors import AdapterError
from slime.agent.adapters.images import content_with_images
from slime.agent.adapters.messages import (
    flatten_content,
    function_tool,
    manager_finish_reason,
    tool_call_dict,
    tool_specs,
)
from slime.agent.parsing import ParsedModelOutput

logger = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIAdapter(BaseAdapter):
    logger = logger
    log_prefix = "openai_adapter"
    max_token_keys = ("max_completion_tokens", "max_tokens", "max_output_tokens")
    stop_keys = ("stop",)

    def _register_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._run_turn)

    def _session_id(self, request: web.Request, body: dict[str, Any]) -> str:
        return _request_session_id(request, body)

    def _translate(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        if body.get("n") not in (None, 1):
            raise AdapterError(400, f"'n' must be 1 (one choice per turn), got {body['n']!r}")
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise AdapterError(400, "'messages' must be a list of messages")
        return _translate_messages(messages, self.history.processor is not None), _tools_to_chat_tools(
            body.get("tools")
        )

    def _build_reply(
        self,
        parsed: ParsedModelOutput,
        raw_finish: str,
        translated: list[dict[str, Any]],
        tools_schema: list[dict[str, Any]] | None,
    ) -> Reply:
        wire_message, manager_message, wire_finish = _build_reply_parts(parsed, raw_finish)
        return Reply(
            manager_message,
            manager_finish_reason(parsed.tool_uses, raw_finish),
            (wire_message, wire_finish),
            complete=len(parsed.tool_uses) <= 1,
        )

    async def _respond(
        self,
        request: web.Request,
        body: dict[str, Any],
        reply: Reply,
        in_tok: int,
        out_tok: int,
        stream: bool,
    ) -> web.StreamResponse:
        wire_message, wire_finish = reply.wire
        if stream:
            return await _render_stream(request, body, wire_message, wire_finish, in_tok, out_tok)
        return web.json_response(_render_response(body, wire_message, wire_finish, in_tok, out_tok))

    def _error(self, error: AdapterError) -> web.Response:
        return web.json_response(
            {"error": {"message": error.message, "type": error.kind, "param": None, "code": None}},
            status=error.status,
        )


def _request_session_id(request: web.Request, body: dict[str, Any]) -> str:
    return sid_from_bearer(request) or sid_from_body(body) or "default"


def _arguments_as_dict(arguments: Any) -> dict[str, Any]:
    """A call's arguments as a mapping: OpenAI sends a JSON string; what does not parse to an
    object is kept as {"_raw_arguments": text} (slime's)."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return {"_raw_arguments": arguments}
        return parsed if isinstance(parsed, dict) else {"_raw_arguments": arguments}
    return {"_raw_arguments": str(arguments)}


def _translate_messages(messages: list[Any], vision: bool = False) -> list[dict[str, Any]]:
    """OpenAI messages → chat-template messages: `developer` is `system`, content flattened to
    text (image parts kept as image items for a vision-language model, `vision`), tool_call ids
    dropped and arguments mappings. A message of an unknown role or shape is refused (slime
    drops it)."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            role = msg.get("role") if isinstance(msg, dict) else None
            raise AdapterError(400, f"messages[{i}]: role {role!r} is not one of {', '.join(ROLES)}")
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise AdapterError(
                400, f"messages[{i}].content must be a string, a list of content parts or null"
            )
        role = "system" if msg["role"] == "developer" else msg["role"]
        if role != "assistant":
            out.append(
                {
                    "role": role,
                    "content": content_with_images(content, flatten_content)
                    if vision
                    else flatten_content(content),
                }
            )
            continue
        # Its reasoning_content is not kept (slime keeps it): the recorded reply has none, so an echo
        # with it (the SDK's model_dump() keeps it) would never match; the held tokens have it.
        assistant: dict[str, Any] = {"role": "assistant", "content": flatten_content(content)}
        calls = msg.get("tool_calls") or []
        if not isinstance(calls, list):
            raise AdapterError(400, f"messages[{i}].tool_calls must be a list")
        normalized = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            name = (function or {}).get("name") or (call.get("name") if isinstance(call, dict) else None)
            if not isinstance(name, str) or not name:
                raise AdapterError(400, f"messages[{i}].tool_calls[{j}] has no function name")
            arguments = (function or {}).get("arguments", call.get("arguments"))
            normalized.append(tool_call_dict(name, _arguments_as_dict(arguments)))
        if normalized:
            assistant["tool_calls"] = normalized
        out.append(assistant)
    return out


def _tools_to_chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI tools (function tools; other types are skipped) → the chat template's schema."""
    out = []
    for tool in tool_specs(tools):
        if tool.get("type", "function") != "function":
            continue
        spec = tool["function"] if isinstance(tool.get("function"), dict) else tool
        if not spec.get("name"):
            raise AdapterError(400, "every tool needs a function name")
        out.append(function_tool(spec["name"], spec.get("description"), spec.get("parameters")))
    return out or None


def _build_reply_parts(parsed: ParsedModelOutput, finish: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(the wire message, the recorded message, the wire finish_reason)."""
    wire: dict[str, Any] = {
        "role": "assistant",
        "content": None if parsed.tool_uses else (parsed.text or None),
    }
    recorded: dict[str, Any] = {
        "role": "assistant",
        "content": "" if parsed.tool_uses else (parsed.text or ""),
    }
    if parsed.reasoning:
        wire["reasoning_content"] = parsed.reasoning
    if parsed.tool_uses:
        use = parsed.tool_uses[0]
        arguments = (
            use.get("input")
            if isinstance(use.get("input"), dict)
            else {"_raw_arguments": str(use.get("input"))}
        )
        wire["tool_calls"] = [
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {
                    "name": use["name"],
                    "arguments": json.dumps(arguments, ensure_ascii=False, sort_keys=True),
                },
            }
        ]
        recorded["tool_calls"] = [tool_call_dict(use["name"], arguments)]
    wire_finish = "tool_calls" if parsed.tool_uses else ("length" if finish == "length" else "stop")
    return wire, recorded, wire_finish


def _usage(in_tok: int, out_tok: int) -> dict[str, int]:
    return {"prompt_tokens": in_tok, "completion_tokens": out_tok, "total_tokens": in_tok + out_tok}


def _render_response(
    body: dict[str, Any], message: dict[str, Any], finish: str, in_tok: int, out_tok: int
) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or "slime-actor",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": _usage(in_tok, out_tok),
    }


async def _render_stream(
    request: web.Request,
    body: dict[str, Any],
    message: dict[str, Any],
    finish: str,
    in_tok: int,
    out_tok: int,
) -> web.StreamResponse:
    """The turn as OpenAI's server-sent events: the role, the reasoning, the content and the tool
    calls in one delta each (the turn is generated whole before it is sent), the finish with the
    usage, then [DONE]."""
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    head = {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.get("model") or "slime-actor",
    }

    async def send(
        delta: dict[str, Any], finish_reason: str | None = None, usage: dict[str, int] | None = None
    ) -> None:
        chunk: dict[str, Any] = {
            **head,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }
        if usage is not None:
            chunk["usage"] = usage
        await out.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())

    await send({"role": "assistant", "content": ""})
    if message.get("reasoning_content"):
        await send({"reasoning_content": message["reasoning_content"]})
    if message.get("content"):
        await send({"content": message["content"]})
    if message.get("tool_calls"):
        await send({"tool_calls": [{**call, "index": i} for i, call in enumerate(message["tool_calls"])]})
    await send({}, finish, _usage(in_tok, out_tok))
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out
