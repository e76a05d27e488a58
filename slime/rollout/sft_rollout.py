"""`slime.rollout.sft_rollout.generate_rollout`: supervised fine-tuning through the RL loop.

As in slime's SFT scripts: `--rollout-function-path slime.rollout.sft_rollout.generate_rollout
--input-key messages --loss-type sft_loss --loss-mask-type qwen3 --debug-train-only`. Each prompt
row is a conversation (a list of chat messages, `metadata["tools"]` optional); its tokens and its
loss mask come from slime.utils.mask_utils: the response is everything from the first token of
the first assistant answer on, and only the assistant answers count in the loss. No engine runs.
"""

from __future__ import annotations

import logging
from typing import Any

from slime.utils.mask_utils import MultiTurnLossMaskGenerator

__all__ = ["generate_rollout"]

logger = logging.getLogger(__name__)

_generators: dict[tuple[str, str], MultiTurnLossMaskGenerator] = {}


def _generator(args: Any) -> MultiTurnLossMaskGenerator:
    key = (args.hf_checkpoint, getattr(args, "loss_mask_type", None) or "qwen")
    if key not in _generators:
        from transformers import AutoTokenizer

        _generators[key] = MultiTurnLossMaskGenerator(AutoTokenizer.from_pretrained(key[0]), key[1])
    return _generators[key]


def generate_rollout(args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False) -> list[Any]:
    """`--rollout-batch-size` conversations, one sample each, with reward 0."""
    if evaluation:
        raise ValueError(
            "slime.rollout.sft_rollout.generate_rollout has no evaluation: drop the evaluation flags"
        )
    masks = _generator(args)
    groups = data_buffer.get_samples(args.rollout_batch_size)
    for k, group in enumerate(groups):
        for sample in group:
            if not isinstance(sample.prompt, list):
                raise ValueError(
                    f"sft_rollout: prompt {sample.metadata.get('prompt_index')} is not a list of chat "
                    "messages (--input-key must name a field holding the conversation)"
                )
            token_ids, loss_mask = masks.get_loss_mask(sample.prompt, tools=sample.metadata.get("tools"))
            response_length = masks.get_response_lengths([loss_mask])[0]
            if response_length == 0:
                raise ValueError(
                    f"sft_rollout: conversation {sample.metadata.get('prompt_index')} has no assistant "
                    "message to learn"
                )
            sample.tokens = token_ids
            sample.response_length = response_length
            sample.loss_mask = loss_mask[-response_length:]
            sample.response = "".join(masks.get_text_from_loss_mask(token_ids, loss_mask))
            sample.reward = 0
            sample.status = sample.Status.COMPLETED
            if k == 0 and rollout_id == 0:
                logger.info(
                    "sft_rollout: %d tokens, %d in the response, %d trained on",
                    len(token_ids),
                    response_length,
                    sum(sample.loss_mask),
                )
    return groups
