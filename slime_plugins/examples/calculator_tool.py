"""A multi-turn generate function with a calculator tool.

    --custom-generate-function-path slime_plugins.examples.calculator_tool.generate

The model answers in turns of at most `TURN_TOKENS` tokens. A turn that ends without the
end-of-sequence token is a call to the calculator: the arithmetic expression at the end of the
turn is evaluated and the tool's answer, `<result>VALUE</result>` (or `<result>error</result>`),
is appended to the response as tokens the model did not generate: loss mask 0, log-prob 0. The
next turn continues from every token so far. After `MAX_TURNS` turns, or when the response budget
(`max_new_tokens`) is spent, the sample ends.

What it shows:
- the engine is called with token ids (`input_ids`: the prompt and the whole response so far),
  never with text, so nothing is re-tokenized: the response holds exactly the tokens the engine
  generated, with the engine's log-probs (`Sample.append_response_tokens`);
- the tool's tokens are masked out of the loss (`trainable=False`);
- the sample's status follows the engine's finish reason (an abort ends the sample at once).
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from typing import Any

from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample

MAX_TURNS = 3
TURN_TOKENS = 6

_OPS: dict[type, Callable[..., float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_EXPRESSION = re.compile(r"[0-9+\-*/(). ]+$")


def calculate(text: str) -> str:
    """The value of the arithmetic expression at the end of `text`, or "error". Only numbers,
    + - * / and parentheses are evaluated (ast, no eval), and numbers stay below 10**12."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and abs(node.value) < 1e12:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")

    found = _EXPRESSION.search(text.rstrip("=").rstrip())
    if found is None or not found.group().strip():
        return "error"
    try:
        result = value(ast.parse(found.group().strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return "error"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    budget = sampling_params["max_new_tokens"]
    sample.loss_mask, sample.rollout_log_probs = [], []
    for turn in range(MAX_TURNS):
        left = budget - sample.response_length
        if left <= 0:
            sample.status = Sample.Status.TRUNCATED
            return sample
        params = {**sampling_params, "max_new_tokens": min(TURN_TOKENS, left)}
        output = await post(
            url, {"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True}
        )
        meta = output["meta_info"]
        pairs = meta.get("output_token_logprobs") or []
        sample.append_response_tokens(
            args,
            tokens=[token for _, token, *_ in pairs],
            log_probs=[log_prob for log_prob, *_ in pairs],
            meta_info=meta,
            text=output["text"],
        )
        finish = meta["finish_reason"]["type"]
        if finish in ("abort", "stop") or turn == MAX_TURNS - 1:
            return sample  # aborted, or the model ended its answer (the status is set)
        answer = f"<result>{calculate(output['text'])}</result>"
        sample.append_response_tokens(
            args,
            tokens=state.tokenizer.encode(answer, add_special_tokens=False),
            trainable=False,
            text=answer,
        )
    return sample
