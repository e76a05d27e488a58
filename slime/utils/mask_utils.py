"""Multi-turn loss masks from a chat template (`slime.utils.mask_utils`, slime's names).

`MultiTurnLossMaskGenerator(tokenizer, tokenizer_type).get_loss_mask(messages, tools=None)`
returns the conversation's token ids and one mask entry per token: 1 on what each assistant
message says (its content and its end-of-turn tokens, as the template writes them), 0 on
everything else (system and user messages, tool results, the assistant header the template puts
before each answer). A message with `"step_loss_mask": 0` is masked out entirely.

How the spans are found (ours): each message is rendered by the tokenizer's own chat template
after a fixed user message, and that message's tokens are cut off again, so a template's
automatic system prompt appears once, at the start; the assistant header is what
`add_generation_prompt=True` adds. This works for templates that write each message
independently of the ones after it: Qwen2/2.5/3 (`qwen`, `qwen3`) and ChatML-style templates such
as the tiny test models'. `distill_qwen` and `qwen3_5` (templates that rewrite earlier turns) are
refused rather than masked wrongly.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MultiTurnLossMaskGenerator", "get_response_lengths"]

SUPPORTED = ("qwen", "qwen3")
_ANCHOR = {"role": "user", "content": "FOR CALCULATING LOSS MASK ONLY"}


def get_response_lengths(loss_masks: list[list[int]]) -> list[int]:
    """Per mask: the length from its first 1 to its end (0 when it has none)."""
    return [len(mask) - mask.index(1) if 1 in mask else 0 for mask in loss_masks]


class MultiTurnLossMaskGenerator:
    def __init__(self, tokenizer: Any, tokenizer_type: str = "qwen"):
        if tokenizer_type not in SUPPORTED:
            raise ValueError(
                f"--loss-mask-type {tokenizer_type!r} is not supported here; supported: "
                f"{', '.join(SUPPORTED)} (templates that write each message independently of the later "
                "ones)"
            )
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template: multi-turn loss masks need one")
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type
        anchor = self._ids([_ANCHOR])
        self._anchor_len = len(anchor)
        self.gen_token_length = len(self._ids([_ANCHOR], add_generation_prompt=True)) - len(anchor)
        # A template's automatic system prompt, written before the anchor when it is alone.
        two = self._ids([_ANCHOR, _ANCHOR])
        self.system_message_length = 2 * len(anchor) - len(two)

    def _ids(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    def get_response_lengths(self, loss_masks: list[list[int]]) -> list[int]:
        return get_response_lengths(loss_masks)

    def _message_ids(self, group: list[dict[str, Any]], first: bool, tools: Any) -> list[int]:
        if first:  # the system prompt (and the tools) belong to the first message
            ids = self._ids([*group, _ANCHOR], tools=tools) if tools else self._ids([*group, _ANCHOR])
            tail = self._anchor_len - self.system_message_length
            return ids[: len(ids) - tail]
        ids = self._ids([_ANCHOR, *group])
        return ids[self._anchor_len :]

    def get_loss_mask(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[int]]:
        token_ids: list[int] = []
        mask: list[int] = []
        i = 0
        while i < len(messages):
            end = i + 1
            if messages[i]["role"] == "tool":  # consecutive tool results share one turn in Qwen's templates
                while end < len(messages) and messages[end]["role"] == "tool":
                    end += 1
            ids = self._message_ids(messages[i:end], i == 0, tools)
            role = messages[i]["role"]
            if role == "assistant" and messages[i].get("step_loss_mask", 1) == 1:
                head = self.gen_token_length
                part = [0] * min(head, len(ids)) + [1] * max(0, len(ids) - head)
            else:
                part = [0] * len(ids)
            token_ids += ids
            mask += part
            i = end
        return token_ids, mask

    def get_text_from_loss_mask(self, token_ids: list[int], loss_masks: list[int]) -> list[str]:
        """The decoded text of every run of 1s."""
        texts, run = [], []
        for t, m in zip(token_ids, loss_masks):
            if m == 1:
                run.append(t)
            elif run:
                texts.append(self.tokenizer.decode(run))
                run = []
        if run:
            texts.append(self.tokenizer.decode(run))
        return texts
