"""An agent that answers arithmetic questions with a python tool: an ordinary OpenAI client
program. It knows nothing of slime; it runs its own tool loop and is given a way to run code.

    python -m slime_plugins.examples.agent_tool.agent --base-url http://HOST:PORT/v1 --api-key KEY \\
        "compute 37*41"

(alone, its tool runs in a subprocess of this machine.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import openai

PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "run Python code and return what it prints",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}

RunCode = Callable[[str], Awaitable[str]]


async def solve(
    client: openai.AsyncOpenAI,
    question: str,
    run_code: RunCode,
    *,
    model: str = "agent",
    max_turns: int = 3,
    max_tokens: int = 96,
) -> str:
    """Ask, run the code the model asks to run, give it the output, until it answers."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    create: Any = client.chat.completions.create  # messages as plain dicts, as most agents write them
    for _ in range(max_turns):
        reply = await create(model=model, messages=messages, tools=[PYTHON_TOOL], max_tokens=max_tokens)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            try:
                code = str(json.loads(call.function.arguments).get("code", ""))
            except (json.JSONDecodeError, AttributeError):
                code = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": await run_code(code)})
    return ""


async def run_in_subprocess(code: str, timeout_s: float = 10.0) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        return "timeout"
    return out.decode(errors="replace").strip()[-200:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--api-key", default="agent")
    p.add_argument("question")
    args = p.parse_args(argv)

    async def run() -> str:
        async with openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key) as client:
            return await solve(client, args.question, run_in_subprocess)

    print(asyncio.run(run()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
