"""The Anthropic Messages adapter: POST /v1/messages (system, content blocks: text, thinking,
tool_use, tool_result; tools; max_tokens, stop_sequences, temperature, top_p, top_k, stream) and
POST /v1/messages/count_tokens.

The session is the bearer token, else the X-Api-Key header (where an Anthropic client sends its
key), else "default" (slime's order). As slime does, a system message in the middle of the list
(which many chat templates refuse) is folded into the user message before it (or after it) as a
<system-reminder> block, and each block of a user message becomes a message of its own (text:
user, tool_result: tool). With a vision-language model's processor, image blocks (base64 or url
sources) in user messages and tool results are images (slime.agent.adapters.images); without
one they are "[image omitted]".
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from functools import partial
from typing import Any

from aiohttp import web

from slime.agent.adapters.common import BaseAdapter, Reply, sid_from_bearer
from slime.agent.adapters.errors import AdapterError
from slime.agent.adapters.images import content_with_images, image_items, session_images
from slime.agent.adapters.messages import (
    flatten_content,
    function_tool,
    manager_finish_reason,
    tool_call_dict,
    tool_specs,
)
from slime.agent.parsing import ParsedModelOutput

logger = logging.getLogger(__name__)

ROLES = ("user", "assistant", "system")


class AnthropicAdapter(BaseAdapter):
    logger = logger
    log_prefix = "anthropic_adapter"
    max_token_keys = ("max_tokens",)
    stop_keys = ("stop_sequences",)

    def _register_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self._run_turn)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)

    def _session_id(self, request: web.Request, body: dict[str, Any]) -> str:
        return _request_session_id(request)

    def _preprocess_body(self, body: dict[str, Any]) -> None:
        _fold_mid_list_system_into_user(body)

    def _translate(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise AdapterError(400, "'messages' must be a list of messages")
        return _translate_messages(
            messages, body.get("system"), self.history.processor is not None
        ), _tools_to_chat_tools(body.get("tools"))

    def _build_reply(
        self,
        parsed: ParsedModelOutput,
        raw_finish: str,
        translated: list[dict[str, Any]],
        tools_schema: list[dict[str, Any]] | None,
    ) -> Reply:
        blocks, stop_reason, recorded = _build_reply_parts(parsed, raw_finish)
        return Reply(recorded, manager_finish_reason(parsed.tool_uses, raw_finish), (blocks, stop_reason))

    async def _respond(
        self,
        request: web.Request,
        body: dict[str, Any],
        reply: Reply,
        in_tok: int,
        out_tok: int,
        stream: bool,
    ) -> web.StreamResponse:
        blocks, stop_reason = reply.wire
        if stream:
            return await _render_stream(request, body, blocks, stop_reason, in_tok, out_tok)
        return web.json_response(_render_response(body, blocks, stop_reason, in_tok, out_tok))

    def _error(self, error: AdapterError) -> web.Response:
        return web.json_response(
            {"type": "error", "error": {"type": error.kind, "message": error.message}}, status=error.status
        )

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """The request's prompt length in tokens, rendered as a turn would be (slime answers 0)."""
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise AdapterError(400, "the request body must be a JSON object")
            self._preprocess_body(body)
            messages, tools = self._translate(body)
            ids = self.history.encode(self.history.render(messages, tools, True)) if messages else []
            extra = 0
            if self.history.processor is not None and image_items(messages):
                # each image's one placeholder token becomes its tokens (decoded and processed off the loop)
                images = await asyncio.get_running_loop().run_in_executor(
                    None, session_images, {}, messages, self.history.processor
                )
                extra = sum(image.num_tokens - 1 for image in images)
        except ValueError as e:
            return self._error(AdapterError(400, f"the request body is not JSON: {e}"))
        except AdapterError as e:
            return self._error(e)
        return web.json_response({"input_tokens": len(ids) + extra})


def _request_session_id(request: web.Request) -> str:
    return sid_from_bearer(request) or (request.headers.get("X-Api-Key") or "").strip() or "default"


def _content(blocks: Any, vision: bool) -> Any:
    """Blocks as chat-template content: text, or text and image items for a vision-language model."""
    return content_with_images(blocks, flatten_content) if vision else flatten_content(blocks)


def _blocks(content: Any, where: str) -> list[Any]:
    if isinstance(content, list):
        return content
    if content is None or isinstance(content, str):
        return [{"type": "text", "text": content or ""}]
    raise AdapterError(400, f"{where}.content must be a string or a list of content blocks")


def _translate_messages(messages: list[Any], system: Any, vision: bool = False) -> list[dict[str, Any]]:
    """Anthropic messages and system → chat-template messages (image blocks, in user messages and
    tool results, kept as image items for a vision-language model, `vision`)."""
    content = partial(_content, vision=vision)
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": flatten_content(system)})
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            role = msg.get("role") if isinstance(msg, dict) else None
            raise AdapterError(400, f"messages[{i}]: role {role!r} is not one of {', '.join(ROLES)}")
        blocks = _blocks(msg.get("content"), f"messages[{i}]")
        if msg["role"] == "system":
            out.append({"role": "system", "content": flatten_content(msg.get("content"))})
        elif msg["role"] == "user":
            for block in blocks:
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    out.append({"role": "tool", "content": content(block.get("content"))})
                elif isinstance(block, dict) and block.get("type") == "text":
                    out.append({"role": "user", "content": str(block.get("text") or "")})
                else:
                    out.append({"role": "user", "content": content([block])})
        else:
            texts, thinking, calls = [], [], []
            for j, block in enumerate(blocks):
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "text":
                    texts.append(str(block.get("text") or ""))
                elif kind == "thinking":
                    thinking.append(str(block.get("thinking") or ""))
                elif kind == "tool_use":
                    if not isinstance(block.get("name"), str) or not block["name"]:
                        raise AdapterError(400, f"messages[{i}].content[{j}]: a tool_use block needs a name")
                    arguments = block.get("input")
                    if arguments is not None and not isinstance(arguments, dict):
                        raise AdapterError(
                            400, f"messages[{i}].content[{j}]: a tool_use input must be an object"
                        )
                    calls.append(tool_call_dict(block["name"], arguments))
            assistant: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if thinking:
                assistant["reasoning_content"] = "".join(thinking)
            if calls:
                assistant["tool_calls"] = calls
            out.append(assistant)
    return out


def _tools_to_chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Anthropic tools → the chat template's; server tools (web search, ...) have no schema."""
    return [
        function_tool(t["name"], t.get("description"), t.get("input_schema") or t.get("parameters"))
        for t in tool_specs(tools)
        if t.get("name")
    ] or None


def _build_reply_parts(
    parsed: ParsedModelOutput, finish: str
) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
    """(the content blocks, the stop_reason, the recorded message)."""
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning})
    if parsed.text:
        blocks.append({"type": "text", "text": parsed.text})
    calls = []
    for use in parsed.tool_uses:
        blocks.append(
            {
                "type": "tool_use",
                "id": f"toolu_{secrets.token_hex(12)}",
                "name": use["name"],
                "input": use["input"],
            }
        )
        calls.append(tool_call_dict(use["name"], use.get("input")))
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    stop_reason = "tool_use" if parsed.tool_uses else ("max_tokens" if finish == "length" else "end_turn")
    recorded: dict[str, Any] = {"role": "assistant", "content": parsed.text or ""}
    if parsed.reasoning:
        recorded["reasoning_content"] = parsed.reasoning
    if calls:
        recorded["tool_calls"] = calls
    return blocks, stop_reason, recorded


def _render_response(
    body: dict[str, Any], blocks: list[dict[str, Any]], stop_reason: str, in_tok: int, out_tok: int
) -> dict[str, Any]:
    return {
        "id": f"msg_{secrets.token_hex(12)}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model") or "slime-actor",
        "content": blocks,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": in_tok, "output_tokens": out_tok},
    }


async def _render_stream(
    request: web.Request,
    body: dict[str, Any],
    blocks: list[dict[str, Any]],
    stop_reason: str,
    in_tok: int,
    out_tok: int,
) -> web.StreamResponse:
    """The turn as Anthropic's events: message_start, each block's start / delta / stop,
    message_delta with the stop reason and usage, message_stop."""
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)

    async def send(event: str, data: dict[str, Any]) -> None:
        await out.write(
            f"event: {event}\ndata: {json.dumps({'type': event, **data}, ensure_ascii=False)}\n\n".encode()
        )

    message = _render_response(body, [], "", in_tok, 0)
    message.update(stop_reason=None, usage={"input_tokens": in_tok, "output_tokens": 0})
    await send("message_start", {"message": message})
    for index, block in enumerate(blocks):
        start: dict[str, Any]
        if block["type"] == "thinking":
            start, delta = (
                {"type": "thinking", "thinking": ""},
                {"type": "thinking_delta", "thinking": block["thinking"]},
            )
        elif block["type"] == "text":
            start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {
                "type": "input_json_delta",
                "partial_json": json.dumps(block["input"], ensure_ascii=False),
            }
        await send("content_block_start", {"index": index, "content_block": start})
        await send("content_block_delta", {"index": index, "delta": delta})
        await send("content_block_stop", {"index": index})
    await send(
        "message_delta",
        {
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": {"input_tokens": in_tok, "output_tokens": out_tok},
        },
    )
    await send("message_stop", {})
    await out.write_eof()
    return out


_REMINDER = "<system-reminder>\n{}\n</system-reminder>\n"


def _fold_mid_list_system_into_user(body: dict[str, Any]) -> bool:
    """Fold every system message past the first position into the nearest user message before it
    (else after it) as a <system-reminder> text block; with no user message it becomes one.
    Changes `body` in place; True if anything was folded."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    late = [i for i, m in enumerate(messages) if i > 0 and isinstance(m, dict) and m.get("role") == "system"]
    if not late:
        return False
    gone: set[int] = set()
    for i in late:
        block = {"type": "text", "text": _REMINDER.format(flatten_content(messages[i].get("content")))}
        users = [j for j in range(i - 1, -1, -1) if j not in gone and _is_user(messages[j])]
        after = [j for j in range(i + 1, len(messages)) if _is_user(messages[j])]
        if users:
            _as_blocks(messages[users[0]]).append(block)
        elif after:
            _as_blocks(messages[after[0]]).insert(0, block)
        else:
            messages[i] = {"role": "user", "content": [block]}
            continue
        gone.add(i)
    body["messages"] = [m for i, m in enumerate(messages) if i not in gone]
    return True


def _is_user(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "user"


def _as_blocks(message: dict[str, Any]) -> list[Any]:
    content = message.get("content")
    if not isinstance(content, list):
        message["content"] = content = [{"type": "text", "text": content if isinstance(content, str) else ""}]
    return content
