"""Images in the torch engine: a request's `image_data` turned into the model's inputs, and the
runner of vision-language models.

A request gives its images with either
- `text`: the prompt with one image placeholder per image (`<|vision_start|><|image_pad|><|vision_end|>`,
  what the chat template writes); the checkpoint's processor expands each placeholder to the
  image's number of tokens, as SGLang does; or
- `input_ids`: already expanded (what the processor gave the rollout): each image's run of pad
  tokens must have exactly that image's number of tokens, or the request is refused naming both.

`BatchedVisionRunner` prefills each prompt with the model's own forward, the vision tower run
once, and the multimodal rotary positions (Qwen-VL's mrope) computed by the model's own
`get_rope_index`: the positions of a sequence's later tokens follow from the offset saved then, so
a decode step feeds no pixels, and decode batches every row like a text model's.
`VisionRunner` is the generic runner (one cache per sequence) with the same prefill, for a
language model the batched runner does not know.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from slime.engines.protocol import GenerateRequest, ProtocolError
from slime.engines.torch_engine.model_runner import BatchedRunner
from slime.engines.torch_engine.runner import GenericRunner
from slime.engines.torch_engine.sequence import Sequence
from slime.utils.model_families import is_vision

logger = logging.getLogger(__name__)


@dataclass
class ImageInputs:
    """The processor's tensors of one request's images."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor  # [images, 3]: temporal, height, width in patches


class ImagePreparer:
    """Decodes a request's images and lays out its token ids (the checkpoint's processor)."""

    def __init__(self, model_path: str, model_config: Any):
        from slime.utils.processing_utils import load_processor

        self.model_path = model_path
        self.processor = load_processor(model_path)
        if self.processor is None:  # text prompts still run (a fine-tune saved without it)
            logger.warning(
                "%s: a vision-language model without an image processor (preprocessor_config.json): "
                "requests with 'image_data' are refused",
                model_path,
            )
        self.image_token_id = int(model_config.image_token_id)
        video = getattr(model_config, "video_token_id", None)
        self.placeholder_ids = [self.image_token_id] + ([int(video)] if video is not None else [])
        # The processor has its own tokenizer: its own lock, so preparing an image in a worker
        # thread never holds up the engine thread's detokenizing.
        self.lock = threading.Lock()

    @staticmethod
    def of(model_path: str, model_config: Any) -> ImagePreparer | None:
        """The preparer of a vision-language model; None for a text model."""
        return ImagePreparer(model_path, model_config) if is_vision(model_config.model_type) else None

    def check_no_images(self, ids: list[int]) -> None:
        """A request without `image_data` must not hold image tokens (they would have no pixels),
        nor any request video tokens (videos are not built)."""
        if self.image_token_id in ids:
            raise ProtocolError(
                f"the prompt holds image tokens (id {self.image_token_id}) but the request has no "
                "'image_data': send the images with the prompt"
            )
        self._check_no_video(ids)

    def _check_no_video(self, ids: list[int]) -> None:
        videos = [t for t in self.placeholder_ids[1:] if t in ids]
        if videos:
            raise ProtocolError(
                f"the prompt holds video tokens (id {videos[0]}): videos are not supported by this engine"
            )

    def prepare_request(self, req: GenerateRequest) -> tuple[list[int], ImageInputs]:
        """A request with `image_data`: its token ids and images."""
        if self.processor is None:
            raise ProtocolError(
                f"'image_data': {self.model_path} has no image processor (preprocessor_config.json); "
                "this engine serves its text prompts only"
            )
        if req.return_logprob and req.logprob_start_len >= 0:
            raise ProtocolError(
                "'logprob_start_len' (input-token log-probs) is not built for prompts with images"
            )
        given = list(req.input_ids) if req.input_ids is not None else None
        return self.prepare(req.image_data, req.text, given)

    def prepare(
        self, images: tuple[str, ...], text: str | None, ids: list[int] | None
    ) -> tuple[list[int], ImageInputs]:
        from slime.utils.processing_utils import ImageError, load_image

        decoded = []
        for i, source in enumerate(images):
            try:
                decoded.append(load_image(source))
            except ImageError as e:
                raise ProtocolError(f"'image_data'[{i}]: {e}") from None
        if text is not None:
            held = text.count(self.processor.image_token)
            if held != len(decoded):
                raise ProtocolError(
                    f"'text' holds {held} image placeholder(s) ({self.processor.image_token}) for "
                    f"{len(decoded)} image(s) in 'image_data': one placeholder per image"
                )
        try:
            if text is not None:
                with self.lock:
                    out = self.processor(text=[text], images=decoded, return_tensors="pt")
                ids = [int(t) for t in out["input_ids"][0]]
            else:
                out = self.processor.image_processor(images=decoded, return_tensors="pt")
        except ValueError as e:  # an image the processor refuses (an extreme aspect ratio, ...)
            raise ProtocolError(f"'image_data': the model's processor refuses an image ({e})") from None
        assert ids is not None
        self._check_no_video(ids)
        inputs = ImageInputs(out["pixel_values"], out["image_grid_thw"])
        self._check_runs(ids, inputs.image_grid_thw)
        return ids, inputs

    def _check_runs(self, ids: list[int], grid: torch.Tensor) -> None:
        """Each image's run of pad tokens has that image's number of tokens."""
        merge = int(self.processor.image_processor.merge_size)
        expected = [int(g.prod()) // merge**2 for g in grid]
        runs: list[int] = []
        for i, token in enumerate(ids):
            if token == self.image_token_id:
                if i and ids[i - 1] == self.image_token_id:
                    runs[-1] += 1
                else:
                    runs.append(1)
        if runs != expected:
            raise ProtocolError(
                f"the prompt's image placeholders do not fit 'image_data': {len(expected)} image(s) of "
                f"{expected} tokens, but the prompt holds {len(runs)} run(s) of image tokens {runs} (give "
                "'text' with one placeholder per image, or 'input_ids' as the checkpoint's processor "
                "expands them)"
            )


def prompt_inputs(model: Any, seq: Sequence, ids: list[int], device: torch.device) -> dict[str, Any]:
    """The model's inputs for the first feed of a sequence (its prompt): its pixels and the
    model's own multimodal rotary positions (`get_rope_index`); the offset of its later tokens'
    positions is saved in `seq.runner_state["rope_delta"]`."""
    tokens = torch.tensor([ids], device=device)
    image_token, video_token = (
        int(model.config.image_token_id),
        int(getattr(model.config, "video_token_id", -1)),
    )
    images: ImageInputs | None = seq.images
    grid = images.image_grid_thw.to(device) if images is not None else None
    token_types = (tokens == image_token).int() + 2 * (tokens == video_token).int()
    positions, delta = model.model.get_rope_index(tokens, token_types, image_grid_thw=grid)
    seq.runner_state["rope_delta"] = int(delta.reshape(-1)[0])
    inputs = {"input_ids": tokens, "position_ids": positions}
    if images is not None:
        inputs.update(pixel_values=images.pixel_values.to(device, model.dtype), image_grid_thw=grid)
    return inputs


def images_of(seq: Sequence) -> int:
    return int(seq.images.image_grid_thw.shape[0]) if seq.images is not None else 0


class VisionRunner(GenericRunner):
    """A vision-language model: the generic runner with pixels at prefill and mrope positions (for
    a model whose language model the batched runner does not know)."""

    def __init__(self, model: Any):
        super().__init__(model)
        self.num_images_encoded = 0
        """Images through the vision tower since start (one per image of each request)."""

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "num_images_encoded": self.num_images_encoded}

    def _inputs(self, seq: Sequence, ids: list[int]) -> dict[str, Any]:
        """The first feed of a sequence (its prompt) gets its pixels and the model's rotary positions;
        later tokens continue from the offset saved then, with no pixels."""
        if seq.num_cached:
            start = seq.num_cached + seq.runner_state["rope_delta"]
            positions = (
                torch.arange(start, start + len(ids), device=self.device).view(1, 1, -1).expand(3, 1, -1)
            )
            return {"input_ids": torch.tensor([ids], device=self.device), "position_ids": positions}
        self.num_images_encoded += images_of(seq)
        return prompt_inputs(self.model, seq, ids, self.device)


class BatchedVisionRunner(BatchedRunner):
    """A vision-language model on the batched runner. Each prompt is prefilled alone by the model's
    own forward (the vision tower once per image, the multimodal rotary positions, Qwen3-VL's
    deepstack features), and what its cache then holds, each attention layer's keys and values
    and a hybrid's linear-attention states, is copied into the sequence's rows. Decode steps batch
    every row over the language model's layers; no image token is fed again, so each row's rotary
    position is its token position plus its prompt's multimodal delta (`rope_offsets`)."""

    multimodal_rope = True

    def __init__(self, model: Any, max_running: int, context_length: int, *args: Any, **kwargs: Any):
        super().__init__(model, max_running, context_length, *args, **kwargs)
        self.num_images_encoded = 0
        """Images through the vision tower since start (one per image of each request)."""

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "num_images_encoded": self.num_images_encoded}

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        return torch.cat([self._prefill_alone(s) for s in seqs])

    def _prefill_alone(self, seq: Sequence) -> torch.Tensor:
        from transformers import DynamicCache

        row, ids = len(self.active), seq.prompt_ids + seq.output_ids
        rows = slice(row, row + 1)
        self._reserve(row + 1, len(ids))
        cache = DynamicCache(config=self.model.config)
        inputs = prompt_inputs(self.model, seq, ids, self.device)
        self.experts.begin([seq])
        with self._lora([seq]):
            logits = self.model(**inputs, past_key_values=cache, use_cache=True).logits[:, -1].float()
        self.experts.keep_prefill([seq], [len(ids)], len(ids))
        self.num_images_encoded += images_of(seq)
        layers: list[Any] = list(cache.layers)  # transformers' cache layers, attention or linear
        for li, layer in enumerate(layers):
            ci = self.cache_index.get(li)
            if ci is not None:
                self.cache.write_prefill(ci, rows, layer.keys, layer.values)
            else:
                assert self.states is not None
                self.states.store(self.states.conv, li, rows, layer.conv_states[0])
                self.states.store(self.states.recurrent, li, rows, layer.recurrent_states[0])
        assert self.rope_offsets is not None  # (multimodal_rope)
        self.rope_offsets[row] = seq.runner_state["rope_delta"]
        seq.num_cached = len(ids)
        self.active.append(seq)
        return logits
