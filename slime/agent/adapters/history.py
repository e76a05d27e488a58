"""A turn's prompt ids: the held tokens of a history the request repeats, not a re-rendering.

A session holds, for each recorded turn, its messages (the prompt's and the reply's as recorded)
and the tokens the engine was given and produced. A request whose messages start with one of
those histories gets that history's tokens, the model's own output included, then the template's
closing of that turn and the new messages rendered after it. Where no held history is repeated,
or the template writes the history differently in a longer conversation (one that rewrites
earlier turns), the request is rendered whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime.agent.adapters.errors import AdapterError
from slime.agent.adapters.images import image_items

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None


@dataclass
class Held:
    """A recorded turn: its messages (the prompt's, then the reply's) and the engine's tokens."""

    messages: Messages
    tools: Tools
    prompt_ids: list[int]
    output_ids: list[int]


class ChatHistory:
    """The served model's chat template and tokenizer, and the reuse of held tokens."""

    def __init__(
        self,
        tokenizer: Any,
        reuse: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        processor: Any = None,
    ):
        self.tokenizer = tokenizer
        self.processor = processor
        """A vision-language model's processor: it expands each image placeholder to the image's tokens."""
        self.reuse = reuse
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._special_ids = set(tokenizer.all_special_ids)
        self._specials = [
            t for t in tokenizer.all_special_tokens if t
        ]  # the tokenizer rebuilds its list per call

    def render(self, messages: Messages, tools: Tools, generation: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=generation,
                **self.chat_template_kwargs,
            )
        except Exception as e:  # jinja's errors: a template that refuses the messages
            raise AdapterError(400, f"the chat template cannot render these messages: {e}") from None

    def encode(self, text: str, images: list[Any] | None = None) -> list[int]:
        if images:
            from slime.utils.processing_utils import expanded_prompt_ids

            placed = text.count(self.processor.image_token)
            if placed != len(images):
                raise AdapterError(
                    400,
                    f"the chat template writes {placed} image placeholder(s) for the {len(images)} "
                    "image(s) of these messages: it leaves out images in some roles (Qwen3-VL's writes "
                    "none in system messages)",
                )
            try:
                return expanded_prompt_ids(self.processor, text, images)
            except ValueError as e:  # an image the processor refuses (an extreme aspect ratio, ...)
                raise AdapterError(
                    400, f"the model's processor refuses an image of the messages: {e}"
                ) from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def visible_text(self, output_ids: list[int]) -> str:
        """The output as text for the parsers and the reply: special tokens kept (a template's
        markers may carry meaning), but not the end-of-turn token the model stopped on."""
        ids = list(output_ids)
        if ids and ids[-1] in self._special_ids:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""

    def prompt_ids(
        self, held: list[Held], messages: Messages, tools: Tools, images: list[Any] | None = None
    ) -> tuple[list[int], Held | None]:
        """The prompt's token ids, and the held turn they continue (None: rendered whole).
        `images`: the messages' images in order (a vision-language model), each placeholder of
        the rendered text expanded to its image's tokens (a held history's are already)."""
        images = images or []
        full = self.render(messages, tools, True)
        if self.reuse:
            for turn in sorted(held, key=lambda h: -len(h.messages)):  # the longest history first
                k = len(turn.messages)
                if k < len(messages) and turn.tools == tools and messages[:k] == turn.messages:
                    try:
                        tail = self._tail(turn, messages, tools, full)
                    except AdapterError:  # the template refuses a part on its own: render it all
                        tail = None
                    if tail is not None:
                        new = len(image_items(messages[k:]))  # the images after the held history
                        return turn.prompt_ids + turn.output_ids + self.encode(
                            tail, images[len(images) - new :]
                        ), turn
                    break  # the template writes this history otherwise in context: render it all
        return self.encode(full, images), None

    def _tail(self, held: Held, messages: Messages, tools: Tools, full: str) -> str | None:
        """The text after the model's output: the end of its turn as the template closes it, then
        the new messages and the generation prompt. None where the template does not write the
        history as a prefix of the whole."""
        k = len(held.messages)
        upto = self.render(messages[:k], tools, False)
        opened = self.render(messages[: k - 1], tools, True)
        if not (full.startswith(upto) and upto.startswith(opened)):
            return None
        rendered = upto[len(opened) :]  # the reply as the template writes it
        output = self.tokenizer.decode(held.output_ids, skip_special_tokens=False)
        if rendered.startswith(output):
            closing = rendered[len(output) :]
        else:  # the template writes the reply otherwise (capitals, a tool call's JSON, no stop token)
            specials = [t for t in self._specials if t in rendered]
            ended = [t for t in specials if output.endswith(t)]
            if ended:  # the model stopped on the template's end token: what the template writes after it
                end = max(ended, key=len)
                closing = rendered[rendered.rindex(end) + len(end) :]
            elif specials:  # cut off, or stopped on another token: the template's end marker onwards
                closing = rendered[max(rendered.rindex(t) for t in specials) :]
            else:
                return None
        return closing + full[len(upto) :]
