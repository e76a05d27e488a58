"""Supervised fine-tuning (a warm start before RL) with the FSDP train actor.

    python -m slime.tools.sft --hf-checkpoint DIR --data FILE --save-hf OUT
        [--input-key prompt] [--response-key response] [--apply-chat-template]
        [--num-epoch 1] [--global-batch-size 64] [--lr 1e-3] [any train flag of train.py]

Each row gives a prompt and the response to learn; the loss covers the response and the end
of sequence token (`--loss-type sft_loss`, the same loss `train.py --loss-type sft_loss` uses).
One rank by default; under `torchrun --nproc-per-node N` the ranks shard the model (FSDP)
and split every batch. The result is written as a Hugging Face checkpoint to `--save-hf`,
with the tokenizer, ready for `train.py --hf-checkpoint`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import socket
import sys
import time
from typing import Any

from slime.config.train import add_train_arguments, train_config_from_args

logger = logging.getLogger("slime.sft")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m slime.tools.sft",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = parser.add_argument_group("sft data")
    g.add_argument("--data", required=True, help="jsonl or parquet file of prompt/response rows")
    g.add_argument("--input-key", default="prompt")
    g.add_argument("--response-key", default="response")
    g.add_argument("--apply-chat-template", action="store_true", help="wrap the prompt as a user turn")
    g.add_argument(
        "--multimodal-keys",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="vision-language models: '{\"image\": FIELD}', the row's images for its <image> placeholders "
        "(as train.py reads them; needs --apply-chat-template)",
    )
    g.add_argument("--num-epoch", type=int, default=1)
    g.add_argument("--save-hf", required=True, help="output Hugging Face checkpoint directory")
    g.add_argument(
        "--train-backend",
        choices=["fsdp", "megatron"],
        default="fsdp",
        help="megatron: the Megatron actor; its layout flags below (TP x PP must divide the ranks)",
    )
    add_train_arguments(parser)
    parser.set_defaults(loss_type="sft_loss", lr=1e-3, global_batch_size=64)
    return parser


def load_examples(
    path: str, tokenizer, input_key: str, response_key: str, chat: bool, multimodal_keys=None, processor=None
) -> list[tuple[list[int], int, dict | None]]:
    """(tokens, response length, the images' processor tensors or None) per row; the response ends
    with the tokenizer's eos token."""
    from slime.rollout.data import DataError, read_rows
    from slime.rollout.vision import messages_with_images
    from slime.utils.processing_utils import expanded_prompt_ids, image_train_inputs

    if multimodal_keys and not chat:
        raise DataError("--multimodal-keys needs --apply-chat-template (the chat template places the images)")
    examples = []
    for where, row in read_rows(path, "--data"):
        for key, flag in ((input_key, "--input-key"), (response_key, "--response-key")):
            if not isinstance(row.get(key), str):
                raise DataError(f"{where}: no text field {key!r} ({flag}); the row has {sorted(row)}")
        prompt = row[input_key]
        images: list = []
        if chat:
            messages = [{"role": "user", "content": prompt}]
            if multimodal_keys:
                messages, images = messages_with_images(where, messages, row, multimodal_keys)
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if images:
            prompt_ids = expanded_prompt_ids(processor, prompt, images)
        else:
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(row[response_key], add_special_tokens=False)["input_ids"]
        response_ids.append(tokenizer.eos_token_id)
        train_inputs = image_train_inputs(processor, images) if images else None
        examples.append((prompt_ids + response_ids, len(response_ids), train_inputs))
    return examples


def _megatron_problem(cfg, world_size: int) -> str | None:
    """The Megatron layout against the ranks and the model, before any process group exists."""
    if cfg.backend != "megatron":
        return None
    from transformers import AutoConfig

    from slime.backends.megatron.convert import ConversionError, Layout
    from slime.backends.megatron.settings import check_supported

    m = cfg.megatron
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    if world_size % model_parallel:
        return (
            f"--tensor-model-parallel-size x --pipeline-model-parallel-size x --context-parallel-size = "
            f"{model_parallel} does not divide the {world_size} ranks"
        )
    try:
        layout = Layout.from_hf_config(
            AutoConfig.from_pretrained(cfg.hf_checkpoint), m.make_vocab_size_divisible_by
        )
        layout.check_parallel(m.tensor_model_parallel_size, m.pipeline_model_parallel_size)
    except (ConversionError, OSError, ValueError) as e:
        return f"--hf-checkpoint {cfg.hf_checkpoint}: {e}"
    return check_supported(m)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    from slime.utils.logging_utils import configure_logging

    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        cfg = train_config_from_args(ns)
    except ValueError as e:
        parser.error(str(e))
    if cfg.loss.loss_type != "sft_loss":
        parser.error("--loss-type must be sft_loss for this tool (it has no rewards)")
    if ns.num_epoch < 1:
        parser.error("--num-epoch must be >= 1")
    problem = _megatron_problem(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    if problem:
        parser.error(problem)
    examples, images = _read_examples(parser, ns, cfg.hf_checkpoint)
    batch_size = cfg.batch.global_batch_size or len(examples)
    if batch_size > len(examples):
        parser.error(
            f"--global-batch-size {batch_size} is larger than the {len(examples)} examples in --data"
        )

    from slime.backends import make_train_actor

    torchrun = "MASTER_ADDR" in os.environ
    actor = (
        make_train_actor(cfg) if torchrun else make_train_actor(cfg, 0, 1, f"tcp://127.0.0.1:{_free_port()}")
    )
    actor.init()
    configure_logging(f"rank {actor.rank}")
    try:
        step = _train(actor, examples, batch_size, ns.num_epoch, random.Random(cfg.seed), images)
        actor.save_hf(ns.save_hf)  # atomic: written beside it and renamed; with the tokenizer
        if actor.rank == 0:
            logger.info("wrote %s after %d steps", ns.save_hf, step)
    finally:
        actor.close()
    return 0


def _read_examples(
    parser: argparse.ArgumentParser, ns: argparse.Namespace, checkpoint: str
) -> tuple[list[Any], bool]:
    """--data tokenized with the checkpoint's tokenizer (and its image processor with
    --multimodal-keys); whether the examples carry images. A bad input is a parser error."""
    from transformers import AutoTokenizer

    from slime.rollout.data import DataError

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    processor = None
    if ns.multimodal_keys:
        from slime.utils.processing_utils import load_processor

        processor = load_processor(checkpoint)
        if processor is None:
            parser.error(f"--multimodal-keys: {checkpoint} has no image processor (preprocessor_config.json)")
    try:
        examples = load_examples(
            ns.data,
            tokenizer,
            ns.input_key,
            ns.response_key,
            ns.apply_chat_template,
            ns.multimodal_keys,
            processor,
        )
    except DataError as e:
        parser.error(str(e))
    return examples, processor is not None


def _train(
    actor: Any, examples: list[Any], batch_size: int, epochs: int, rng: random.Random, images: bool
) -> int:
    """`epochs` passes over the examples in shuffled batches (the last partial one dropped), a
    train call each; returns the steps taken."""
    from slime.utils.rollout_batch import RolloutBatch

    step, start = 0, time.perf_counter()
    for epoch in range(epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        losses: list[float] = []
        for lo in range(0, len(order) - batch_size + 1, batch_size):
            chosen = [examples[i] for i in order[lo : lo + batch_size]]
            batch = RolloutBatch(
                tokens=[t for t, _, _ in chosen],
                response_lengths=[n for _, n, _ in chosen],
                rewards=[0.0] * len(chosen),
                group_indices=list(range(len(chosen))),
                multimodal_train_inputs=[m for _, _, m in chosen] if images else None,
            )
            out = actor.train(step, batch)
            losses.extend(s["loss"] for s in out.steps)
            step += 1
        if actor.rank == 0:
            logger.info(
                "epoch %d/%d: %d steps, loss %.4f (last %.4f), %.1f s",
                epoch + 1,
                epochs,
                len(losses),
                sum(losses) / len(losses),
                losses[-1],
                time.perf_counter() - start,
            )
    return step


if __name__ == "__main__":
    sys.exit(main())
