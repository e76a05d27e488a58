"""The FSDP actor training a vision-language model (tiny Qwen3-VL) on real gloo ranks: packed and
padded micro-batches, the frozen and the trained vision tower, one rank and two (with a
micro-batch holding no image on one of them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slime.config.train import FSDPConfig
from slime.utils.rollout_batch import RolloutBatch
from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import base_config

TEXT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many "
    "dots?<|im_end|>\n<|im_start|>assistant\n"
)
PLAIN = "<|im_start|>user\nno image<|im_end|>\n<|im_start|>assistant\n"


def vision_batch(model: str, n: int = 8) -> RolloutBatch:
    """Samples with images of other sizes (64 x 32 and 64 x 64) and, every third, none."""
    import numpy as np
    from PIL import Image

    from slime.utils.processing_utils import expanded_prompt_ids, image_train_inputs, load_processor

    processor = load_processor(model)
    g = torch.Generator().manual_seed(0)
    tokens, lengths, inputs = [], [], []
    for i in range(n):
        if i % 3 == 2:
            ids, train = processor.tokenizer.encode(PLAIN), None
        else:
            pixels = (np.random.RandomState(i).rand(64, 32 + 32 * (i % 2), 3) * 255).astype("uint8")
            image = Image.fromarray(pixels)
            ids, train = (
                expanded_prompt_ids(processor, TEXT, [image]),
                image_train_inputs(processor, [image]),
            )
        r = 3 + i
        tokens.append(ids + torch.randint(4, 100, (r,), generator=g).tolist())
        lengths.append(r)
        inputs.append(train)
    return RolloutBatch(
        tokens,
        lengths,
        [float(i % 2) for i in range(n)],
        [i // 2 for i in range(n)],
        [[1] * r for r in lengths],
        [[-4.0] * r for r in lengths],
        multimodal_train_inputs=inputs,
    )


def run(rank, world_size, init_method, model, padded, train_vision, micro_batch_size=2):
    from slime.backends.fsdp.actor import FSDPTrainActor

    cfg = base_config(model, micro_batch_size=micro_batch_size, padded_micro_batches=padded)
    cfg = dataclasses.replace(cfg, fsdp=FSDPConfig(train_vision_model=train_vision))
    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    actor.init()
    batch = vision_batch(model)
    before = {n: p.full_tensor().clone() for n, p in actor.backend.model.named_parameters()}
    out = dict(
        log_probs=actor.compute_log_probs(batch), ref=actor.compute_log_probs(batch, use_reference=True)
    )
    out["steps"] = actor.train(0, batch).steps
    after = {n: p.full_tensor().clone() for n, p in actor.backend.model.named_parameters()}
    out["moved"] = {n for n in before if not torch.equal(before[n], after[n])}
    out["pushed"] = {n for bucket in actor.export_weights(bucket_bytes=1 << 20) for n, _ in bucket}
    out["names"] = set(before)
    actor.close()
    return out


@pytest.fixture(scope="module")
def runs(tiny_vlm):
    return {
        "packed": run_ranks(1, run, tiny_vlm, False, False)[0],
        "padded": run_ranks(1, run, tiny_vlm, True, False)[0],
        # one sample per micro-batch: some hold no image, on one rank while the other's does
        "vision": run_ranks(1, run, tiny_vlm, False, True, 1)[0],
        "vision_two": run_ranks(2, run, tiny_vlm, False, True, 1),
    }


def _hf_log_probs(model_dir: str, batch: RolloutBatch) -> list[torch.Tensor]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for ids, r, images in zip(batch.tokens, batch.response_lengths, batch.multimodal_train_inputs or []):
        t = torch.tensor([ids])
        with torch.no_grad():
            logits = (
                model(
                    input_ids=t, mm_token_type_ids=(t == model.config.image_token_id).int(), **(images or {})
                )
                .logits[0]
                .float()
            )
        n = len(ids)
        out.append(torch.log_softmax(logits[n - r - 1 : n - 1], -1).gather(-1, t[0, n - r :, None])[:, 0])
    return out


def test_log_probs_equal_the_model_packed_or_padded(runs, tiny_vlm):
    reference = _hf_log_probs(tiny_vlm, vision_batch(tiny_vlm))
    for layout in ("packed", "padded"):
        for i, ref in enumerate(reference):
            got = torch.as_tensor(runs[layout]["log_probs"][i])
            assert (got - ref).abs().max().item() < 1e-5, (layout, i)


def test_step0_kl_is_exactly_zero_and_layouts_train_alike(runs):
    packed = runs["packed"]
    for i, lp in packed["log_probs"].items():
        assert torch.equal(torch.as_tensor(lp), torch.as_tensor(packed["ref"][i]))
    assert packed["steps"][0]["kl_loss"] == 0.0
    for other in (runs["padded"],):
        for a, b in zip(packed["steps"], other["steps"], strict=True):
            for key in ("loss", "pg_loss", "grad_norm", "entropy"):
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), key


def test_the_vision_tower_is_frozen_unless_asked_and_every_weight_is_pushed(runs):
    frozen, trained = runs["packed"], runs["vision"]
    visual = {n for n in frozen["names"] if ".visual." in n}
    assert visual and not frozen["moved"] & visual
    assert frozen["moved"]  # the language model trained
    assert visual <= trained["moved"]  # --train-vision-model
    for r in (frozen, trained):
        assert r["pushed"] == r["names"]  # the push covers the vision tower's weights
    # a trained tower on two ranks, one of them on a micro-batch with no image: the ranks agree
    # on their gradient reductions (FSDP reduces zeros for the tower there) and train like one
    for rank in runs["vision_two"]:
        assert rank["moved"] == trained["moved"]
        for a, b in zip(trained["steps"], rank["steps"], strict=True):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), key


def test_megatron_refuses_a_vision_language_model_by_name(tiny_vlm):
    pytest.importorskip("megatron.core")
    from transformers import AutoConfig

    from slime.backends.megatron.convert import ConversionError, Layout

    with pytest.raises(
        ConversionError, match=r"'qwen3_vl'.*vision-language models train with --train-backend fsdp"
    ):
        Layout.from_hf_config(AutoConfig.from_pretrained(tiny_vlm))


def test_a_critic_of_a_vision_language_model_is_refused_by_name(tiny_vlm):
    from transformers import AutoConfig

    from slime.backends.fsdp.model_init import build_meta_model
    from slime.backends.hf_checkpoint import CheckpointError

    with pytest.raises(
        CheckpointError,
        match=r"'qwen3_vl': a value model .* of this model is not "
        "built with FSDP \\(transformers has no token classifier of it\\)",
    ):
        build_meta_model(AutoConfig.from_pretrained(tiny_vlm), "sdpa", value_head=True)


def test_lora_on_qwen3_vl_adapts_its_language_model_only(tiny_vlm):
    """All-linear LoRA on Qwen3-VL: adapters on every linear layer of the language model, none on
    the vision tower (its DeepStack mergers included) or the LM head (the training and the push
    are tested on Qwen3.5: tests/test_qwen3_5_vl.py)."""
    from transformers import AutoModelForImageTextToText

    from slime.backends.fsdp.lora import inject, tower_linear
    from slime.config.lora import LoRAConfig

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm)
    tower = tower_linear(model)
    assert tower and any("deepstack" in n for n in tower)
    language = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in tower]
    model = inject(model, LoRAConfig(rank=4, alpha=8, target_modules=("all-linear",)))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted == {n for n in language if n != "lm_head"}
