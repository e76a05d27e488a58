"""The agent example's task: products a*b (10 <= a <= 99, 2 <= b <= 9) the agent may compute
with its python tool, and the SFT warm start.

    python -m slime_plugins.examples.agent_tool.task --out DIR --hf-checkpoint MODEL [--seed 0]

Writes DIR/train.jsonl and DIR/eval.jsonl (prompt: "compute 37*4", label: "148"; the eval
problems are never trained on) and DIR/sft.jsonl, rows of prompt and response, the prompt
rendered with MODEL's chat template as the adapter renders it (the tool offered): each turn of a
run that calls the tool (the tool call, then the answer read from the tool's output) and, for
`--direct-fraction` of the problems, also an answer given at once, from memory (which a tiny
model gets wrong on problems it has not seen). After SFT the model answers at once about half
of the time; what RL has to find is that calling the tool pays.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Any

from slime_plugins.examples.agent_tool.agent import PYTHON_TOOL


def problems() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10, 100) for b in range(2, 10)]


def question(a: int, b: int) -> str:
    return f"compute {a}*{b}"


def sft_rows(tokenizer: Any, a: int, b: int) -> list[dict[str, str]]:
    """The two turns of a correct run: the tool call, then the answer from the tool's output."""
    call = {"type": "function", "function": {"name": "python", "arguments": {"code": f"print({a}*{b})"}}}
    user = {"role": "user", "content": question(a, b)}
    turns: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
        ([user], {"role": "assistant", "content": "", "tool_calls": [call]}),
        (
            [
                user,
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": str(a * b)},
            ],
            {"role": "assistant", "content": str(a * b)},
        ),
    ]
    rows = []
    for history, reply in turns:
        prompt = tokenizer.apply_chat_template(
            history, tools=[PYTHON_TOOL], tokenize=False, add_generation_prompt=True
        )
        whole = tokenizer.apply_chat_template([*history, reply], tools=[PYTHON_TOOL], tokenize=False)
        response = whole[len(prompt) :]
        end = tokenizer.eos_token
        assert whole.startswith(prompt) and end in response, (
            "the chat template must close a reply with its eos"
        )
        rows.append({"prompt": prompt, "response": response[: response.rindex(end)]})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument(
        "--hf-checkpoint", required=True, help="the model whose chat template renders the SFT prompts"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-eval", type=int, default=120)
    p.add_argument("--num-sft", type=int, default=300)
    p.add_argument("--direct-fraction", type=float, default=1.0)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
    todo = problems()
    random.Random(args.seed).shuffle(todo)
    held_out, train = todo[: args.num_eval], todo[args.num_eval :]
    os.makedirs(args.out, exist_ok=True)
    for name, rows in (("train", train), ("eval", held_out)):
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            for a, b in rows:
                f.write(json.dumps({"prompt": question(a, b), "label": str(a * b)}) + "\n")
    sft: list[dict[str, str]] = []
    for k, (a, b) in enumerate(train[: args.num_sft]):
        tool_rows = sft_rows(tokenizer, a, b)
        direct = k < args.direct_fraction * min(args.num_sft, len(train))
        sft += tool_rows + ([{"prompt": tool_rows[0]["prompt"], "response": str(a * b)}] if direct else [])
    random.Random(args.seed + 1).shuffle(sft)
    with open(os.path.join(args.out, "sft.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in sft)
    print(f"{len(train)} train, {len(held_out)} held-out problems, {len(sft)} SFT rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
