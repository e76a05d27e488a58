"""The prompt data source: jsonl or parquet rows → prompts, shuffled per epoch, resumable.

Rows are read and checked once at start-up, so a malformed line or a missing key is one clear
error naming file:line before any process starts. Prompts longer than
--rollout-max-prompt-len tokens are dropped (the count is logged). The position in the data
(epoch, offset) is part of the checkpoint, so a resumed run continues with the next prompt.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from typing import Any

from slime.config.rollout import DataConfig
from slime.rollout.vision import messages_with_images
from slime.utils.data_files import DataError, read_rows
from slime.utils.processing_utils import expanded_prompt_ids

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """One row of the prompt data, ready for generation."""

    index: int  # row number in the file (0-based), stable across shuffles
    prompt: str | list[dict[str, Any]]  # what the user wrote (text or chat messages)
    text: str  # what the engine receives (chat template applied if asked)
    token_ids: list[int]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    images: tuple[Any, ...] = ()
    """--multimodal-keys: the prompt's images (RGB PIL), in the order of its placeholders;
    `token_ids` has each placeholder expanded to its image's tokens."""


def prompt_messages(cfg: DataConfig, where: str, row: dict[str, Any]) -> list[Any]:
    """The row's prompt as chat messages; DataError names the row and the flag to fix."""
    if cfg.input_key not in row:
        raise DataError(f"{where}: no field {cfg.input_key!r} (--input-key); fields are {sorted(row)}")
    raw = row[cfg.input_key]
    if cfg.label_key is not None and cfg.label_key not in row and not cfg.messages_as_is:
        raise DataError(f"{where}: no field {cfg.label_key!r} (--label-key); fields are {sorted(row)}")
    if isinstance(raw, list):
        if not cfg.apply_chat_template and not cfg.messages_as_is:
            raise DataError(f"{where}: the prompt is a list of chat messages; add --apply-chat-template")
        return raw
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    raise DataError(f"{where}: field {cfg.input_key!r} must be a string or a list of messages")


def row_tools(cfg: DataConfig, where: str, row: dict[str, Any]) -> list[Any] | None:
    """The row's tool schemas under --tool-key (a list, or its JSON text; parquet's arrays as
    lists), as slime reads them; None when the row has none."""
    if cfg.tool_key is None or row.get(cfg.tool_key) is None:
        return None
    tools = row[cfg.tool_key]
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: field {cfg.tool_key!r} (--tool-key) is not JSON ({e})") from None
    if hasattr(tools, "tolist"):
        tools = tools.tolist()
    if not isinstance(tools, list):
        raise DataError(f"{where}: field {cfg.tool_key!r} (--tool-key) must be a list of tool schemas")
    return tools


def check_prompt_file(cfg: DataConfig, flag: str = "--prompt-data", processor: Any = None) -> int:
    """Read every row of the file and check its fields, without tokenizing (the driver does
    this before any process starts); returns the number of rows. `processor`: with
    --multimodal-keys, the checkpoint's, which checks every image too."""
    rows = read_rows(cfg.prompt_data, flag)
    for where, row in rows:
        messages = prompt_messages(cfg, where, row)
        if cfg.multimodal_keys:
            messages_with_images(where, messages, row, cfg.multimodal_keys, processor)
    return len(rows)


class PromptDataset:
    """Prompts in epoch order; `next_batch(n)` crosses epoch boundaries."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, flag: str = "--prompt-data", processor: Any = None):
        """`processor`: the checkpoint's multimodal processor (slime.utils.processing_utils),
        needed with --multimodal-keys."""
        self.cfg = cfg
        self.processor = processor
        if cfg.multimodal_keys and processor is None:
            raise DataError(
                "--multimodal-keys: the checkpoint has no image processor (preprocessor_config.json); "
                "is it a vision-language model?"
            )
        self.prompts: list[Prompt] = []
        dropped = 0
        for position, (where, row) in enumerate(read_rows(cfg.prompt_data, flag)):
            prompt = self._make_prompt(position, where, row, tokenizer)
            if cfg.max_prompt_len is not None and len(prompt.token_ids) > cfg.max_prompt_len:
                dropped += 1
                continue
            self.prompts.append(prompt)
        if dropped:
            logger.warning(
                "%s: dropped %d of %d prompts longer than --rollout-max-prompt-len %s tokens",
                cfg.prompt_data,
                dropped,
                dropped + len(self.prompts),
                cfg.max_prompt_len,
            )
        if not self.prompts:
            raise DataError(
                f"{flag} {cfg.prompt_data!r}: every prompt is longer than --rollout-max-prompt-len "
                f"{cfg.max_prompt_len}"
            )
        self.epoch = 0
        self.offset = 0
        self.returned: list[int] = []
        """Positions in `prompts` drawn before the epoch's next ones (give_back)."""
        self._order = self._epoch_order(0)

    def _make_prompt(self, position: int, where: str, row: dict[str, Any], tokenizer: Any) -> Prompt:
        cfg = self.cfg
        messages = prompt_messages(cfg, where, row)
        raw = row[cfg.input_key]
        tools = row_tools(cfg, where, row)
        images: list[Any] = []
        if cfg.multimodal_keys:
            messages, images = messages_with_images(where, messages, row, cfg.multimodal_keys)
        if cfg.apply_chat_template:
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=True,
                **(cfg.apply_chat_template_kwargs or {}),
            )
        elif isinstance(raw, str):
            text = raw
        else:  # messages kept as they are (cfg.messages_as_is): the rollout function tokenizes them
            text = ""
        if images:
            ids = expanded_prompt_ids(self.processor, text, images)
        else:
            ids = list(tokenizer.encode(text, add_special_tokens=False)) if text else []
        metadata = row.get(cfg.metadata_key) if cfg.metadata_key else None
        metadata = dict(metadata) if isinstance(metadata, dict) else {}
        if tools is not None:
            metadata["tools"] = tools
        return Prompt(
            index=position,
            prompt=raw,
            text=text,
            token_ids=ids,
            label=row.get(cfg.label_key) if cfg.label_key else None,
            metadata=metadata,
            images=tuple(images),
        )

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.cfg.shuffle:
            random.Random(self.cfg.seed + epoch).shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self.prompts)

    def give_back(self, prompts: list[Prompt]) -> None:
        """Prompts drawn but not trained on (in flight when a checkpoint was taken, or requeued):
        the next draws return them first, in order, before the epoch goes on."""
        self.returned.extend(p.index for p in prompts)

    def next_batch(self, num_prompts: int) -> list[Prompt]:
        out: list[Prompt] = []
        while self.returned and len(out) < num_prompts:
            out.append(self.prompts[self.returned.pop(0)])
        while len(out) < num_prompts:
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
            take = min(num_prompts - len(out), len(self._order) - self.offset)
            out.extend(self.prompts[i] for i in self._order[self.offset : self.offset + take])
            self.offset += take
        return out

    def state_dict(self, pending: list[Prompt] | None = None) -> dict[str, Any]:
        """The position, and the prompts to draw again first (returned ones, then `pending`:
        drawn but not yet trained on)."""
        state: dict[str, Any] = {"epoch": self.epoch, "offset": self.offset}
        returned = self.returned + [p.index for p in pending or []]
        if returned:
            state["returned"] = returned
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.returned = [int(i) for i in state.get("returned", [])]
        self._order = self._epoch_order(self.epoch)
