"""A model's decoded output → its reasoning, visible text and tool calls.

The parsers are chosen by name as SGLang names them (`--tool-call-parser`, `--reasoning-parser`).
Built here, needing no SGLang: the Hermes / Qwen `<tool_call>{"name": ..., "arguments": ...}
</tool_call>` format (`hermes`, `qwen`, `qwen25`, `qwen3`), and the `<think>...</think>`
reasoning block (`qwen3`, `qwen3-thinking`, `deepseek-r1`, `deepseek-v3`, `glm45`, `kimi`). Any
other name is SGLang's parser of that name, used where SGLang is installed and refused by name
where it is not. `register_tool_parser` / `register_reasoning_parser` add a format.

A tool call the parser cannot read (JSON that does not parse, a tool the request did not offer,
an unclosed tag) is not executed: it stays in the visible text and the turn is marked
`ill_formed`, so the agent sees what the model wrote and the trainer can tell such turns apart.
Without a tool parser, slime's fallback reads Anthropic-style XML tool calls
(`<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ToolParser = Callable[[str, set[str]], "tuple[str, list[dict[str, Any]], bool]"]
"""(text, offered tool names) → (visible text, [{"name", "input"}], ill_formed)."""
ReasoningParser = Callable[[str], "tuple[str, str]"]
"""text → (reasoning, the rest)."""

TOOL_PARSERS: dict[str, ToolParser] = {}
REASONING_PARSERS: dict[str, ReasoningParser] = {}


@dataclass(frozen=True)
class ParsedModelOutput:
    """One decoded model output, parsed."""

    reasoning: str
    text: str
    tool_uses: list[dict[str, Any]]
    ill_formed: bool = False


def register_tool_parser(*names: str) -> Callable[[ToolParser], ToolParser]:
    def register(fn: ToolParser) -> ToolParser:
        for name in names:
            TOOL_PARSERS[name] = fn
        return fn

    return register


def register_reasoning_parser(*names: str) -> Callable[[ReasoningParser], ReasoningParser]:
    def register(fn: ReasoningParser) -> ReasoningParser:
        for name in names:
            REASONING_PARSERS[name] = fn
        return fn

    return register


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@register_tool_parser("hermes", "qwen", "qwen25", "qwen3")
def parse_hermes(text: str, offered: set[str]) -> tuple[str, list[dict[str, Any]], bool]:
    """`<tool_call>{"name": NAME, "arguments": {...}}</tool_call>` blocks (arguments may be a
    JSON-encoded string, as some models write them)."""
    uses: list[dict[str, Any]] = []
    kept: list[str] = []
    ill_formed = False
    last = 0
    for m in _TOOL_CALL.finditer(text):
        call = _hermes_call(m.group(1), offered)
        if call is None:
            ill_formed = True
            continue  # the block stays in the visible text
        uses.append(call)
        kept.append(text[last : m.start()])
        last = m.end()
    if text.count("<tool_call>") > text.count("</tool_call>"):  # opened and never closed
        ill_formed = True
    kept.append(text[last:])
    return "".join(kept), uses, ill_formed


def _hermes_call(inner: str, offered: set[str]) -> dict[str, Any] | None:
    try:
        call = json.loads(inner.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in offered:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": call["name"], "input": arguments}


@register_reasoning_parser("qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "glm45", "kimi")
def parse_think(text: str) -> tuple[str, str]:
    """`<think>REASONING</think>REST`; also REASONING</think>REST, where the chat template opened
    the block in the prompt."""
    if "</think>" not in text:
        return "", text
    reasoning, rest = text.split("</think>", 1)
    return reasoning.replace("<think>", "", 1).strip(), rest


def tool_names(tools_schema: list[dict[str, Any]] | None) -> set[str]:
    names = ((t.get("function") or {}).get("name") for t in tools_schema or ())
    return {n for n in names if isinstance(n, str)}


def check_parser_names(tool_parser: str | None, reasoning_parser: str | None) -> None:
    """Raise ValueError naming a parser that is neither built here nor SGLang's (installed)."""
    for kind, name, built in (
        ("tool-call", tool_parser, TOOL_PARSERS),
        ("reasoning", reasoning_parser, REASONING_PARSERS),
    ):
        if name is None or name in built:
            continue
        try:
            import sglang  # noqa: F401
        except ImportError:
            raise ValueError(
                f"{kind} parser {name!r} is not built here (built: {', '.join(sorted(built))}) and SGLang, "
                "whose parser it would be, is not installed"
            ) from None


def parse_model_output(
    raw_output: str,
    *,
    tools_schema: list[dict[str, Any]] | None,
    tool_parser_name: str | None,
    reasoning_parser_name: str | None,
) -> ParsedModelOutput:
    """The reasoning (with a reasoning parser), the visible text and the tool calls of one
    output; tool calls only where the request offered tools."""
    reasoning, body = "", raw_output
    if reasoning_parser_name:
        if reasoning_parser_name in REASONING_PARSERS:
            reasoning, body = REASONING_PARSERS[reasoning_parser_name](raw_output)
        else:
            reasoning, body = _sglang_reasoning(raw_output, reasoning_parser_name)
    body, uses, ill_formed = parse_tool_uses(body, tools_schema, tool_parser_name)
    return ParsedModelOutput(reasoning=reasoning, text=body.strip(), tool_uses=uses, ill_formed=ill_formed)


def parse_tool_uses(
    body_text: str, tools_schema: list[dict[str, Any]] | None, tool_parser_name: str | None
) -> tuple[str, list[dict[str, Any]], bool]:
    """(visible text, tool uses [{"name", "input"}], ill_formed)."""
    if not tools_schema:
        return body_text, [], False
    uses: list[dict[str, Any]] = []
    ill_formed = False
    if tool_parser_name:
        if tool_parser_name in TOOL_PARSERS:
            body_text, uses, ill_formed = TOOL_PARSERS[tool_parser_name](body_text, tool_names(tools_schema))
        else:
            body_text, uses, ill_formed = _sglang_tool_uses(body_text, tools_schema, tool_parser_name)
    if not uses:
        body_text, uses = parse_xml_tool_uses(body_text, tools_schema)
    return body_text, uses, ill_formed


_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>]+)>(.*?)</parameter>", re.DOTALL)


def parse_xml_tool_uses(
    body_text: str, tools_schema: list[dict[str, Any]]
) -> tuple[str, list[dict[str, Any]]]:
    """slime's fallback: XML tool calls of offered tools, their parameters as strings."""
    offered = tool_names(tools_schema)
    uses: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for m in _XML_CALL.finditer(body_text):
        if m.group(1) not in offered:
            continue
        uses.append(
            {
                "name": m.group(1),
                "input": {p.group(1): p.group(2).strip() for p in _XML_PARAM.finditer(m.group(2))},
            }
        )
        kept.append(body_text[last : m.start()])
        last = m.end()
    kept.append(body_text[last:])
    return "".join(kept), uses


def _sglang_tool_uses(
    text: str, tools_schema: list[dict[str, Any]], name: str
) -> tuple[str, list[dict[str, Any]], bool]:
    """SGLang's parser `name` (check_parser_names refused it at start where SGLang is missing)."""
    from sglang.srt.entrypoints.openai.protocol import Function, Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    parser = FunctionCallParser(
        tools=[Tool(type="function", function=Function(**t["function"])) for t in tools_schema],
        tool_call_parser=name,
    )
    if not parser.has_tool_call(text):
        return text, [], False
    text, calls = parser.parse_non_stream(text)
    uses, ill_formed = [], False
    for call in calls:
        try:
            arguments = json.loads(call.parameters or "{}")
        except json.JSONDecodeError:
            ill_formed = True
            continue
        uses.append({"name": call.name, "input": arguments if isinstance(arguments, dict) else {}})
    return text, uses, ill_formed


def _sglang_reasoning(text: str, name: str) -> tuple[str, str]:
    from sglang.srt.parser.reasoning_parser import ReasoningParser as SGLangReasoningParser

    reasoning, rest = SGLangReasoningParser(model_type=name, stream_reasoning=False).parse_non_stream(text)
    return reasoning or "", rest or ""
