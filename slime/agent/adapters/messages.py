"""Chat-template messages and tools as both adapters translate to them: a message's content as
text, a tool call as recorded, a tool as the chat template takes it, the recorded finish reason."""

from __future__ import annotations

from typing import Any

from slime.agent.adapters.errors import AdapterError


def flatten_content(c: Any) -> str:
    """A message's content (a string, or OpenAI / Anthropic content blocks) as chat-template text:
    text blocks joined by newlines, tool results flattened, images as "[image omitted]"."""
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        return str(c)
    parts = []
    for block in c:
        if isinstance(block, str):
            parts.append(block)
        elif not isinstance(block, dict):
            parts.append(str(block))
        elif block.get("type") in ("text", "input_text", "output_text"):
            parts.append(str(block.get("text") or ""))
        elif block.get("type") in ("image", "image_url", "input_image"):
            parts.append("[image omitted]")
        elif "content" in block:
            parts.append(flatten_content(block["content"]))
        elif "text" in block:
            parts.append(str(block.get("text") or ""))
    return "\n".join(p for p in parts if p)


def tool_call_dict(name: str, arguments: dict[str, Any] | None) -> dict[str, Any]:
    """A tool call as recorded: no wire id, arguments a mapping (the chat template wants one, and
    the echo of the call must compare equal to the recorded message)."""
    return {"type": "function", "function": {"name": name, "arguments": arguments or {}}}


def function_tool(name: str, description: Any, parameters: Any) -> dict[str, Any]:
    """A tool as the chat template takes it (a function with a JSON-schema of parameters)."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description or "",
            "parameters": parameters or {"type": "object", "properties": {}},
        },
    }


def tool_specs(tools: Any) -> list[dict[str, Any]]:
    """The request's `tools`, a list (400 otherwise); [] when absent."""
    if not tools:
        return []
    if not isinstance(tools, list):
        raise AdapterError(400, "'tools' must be a list")
    return [t for t in tools if isinstance(t, dict)]


def manager_finish_reason(tool_uses: list[dict[str, Any]], raw_finish: str) -> str:
    return "tool_calls" if tool_uses else (raw_finish or "stop")
