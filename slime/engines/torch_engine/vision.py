"""Images in the torch engine: a request's `image_data` turned into the model's inputs, and the
runner of vision-language models.

A request gives its images with either
- `text`: the prompt with one image placeholder per image (`<|vision_start|><|image_pad|><|vision_end|>`,
  what the chat template writes); the checkpoint's processor expands each placeholder to the
  image's number of tokens, as SGLang does; or
- `input_ids`: already expanded (what the processor gave the rollout): each image's run of pad
  tokens must have exactly that image's number of tokens, or the request is refused naming both.

`VisionRunner` is the generic runner (one cache per sequence, the model's own forward) with the
vision tower run once, at the prefill that first feeds the prompt, and the multimodal rotary
positions (Qwen-VL's mrope) computed by the model's own `get_rope_index`: the positions of a
sequence's later tokens follow from the offset saved then, so a decode step feeds no pixels.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from slime.engines.protocol import GenerateRequest, ProtocolError
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


class VisionRunner(GenericRunner):
    """A vision-language model: the generic runner with pixels at prefill and mrope positions."""

    def __init__(self, model: Any):
        super().__init__(model)
        self.num_images_encoded = 0
        """Images through the vision tower since start (one per image of each request)."""
        self.image_token_id = int(model.config.image_token_id)
        self.video_token_id = int(getattr(model.config, "video_token_id", -1))

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "num_images_encoded": self.num_images_encoded}

    def _inputs(self, seq: Sequence, ids: list[int]) -> dict[str, Any]:
        """The first feed of a sequence (its prompt) gets its pixels and the model's rotary positions;
        later tokens continue from the offset saved then, with no pixels."""
        tokens = torch.tensor([ids], device=self.device)
        if seq.num_cached:
            start = seq.num_cached + seq.runner_state["rope_delta"]
            positions = (
                torch.arange(start, start + len(ids), device=self.device).view(1, 1, -1).expand(3, 1, -1)
            )
            return {"input_ids": tokens, "position_ids": positions}
        images: ImageInputs | None = seq.images
        grid = images.image_grid_thw.to(self.device) if images is not None else None
        token_types = (tokens == self.image_token_id).int() + 2 * (tokens == self.video_token_id).int()
        positions, delta = self.model.model.get_rope_index(tokens, token_types, image_grid_thw=grid)
        seq.runner_state["rope_delta"] = int(delta.reshape(-1)[0])
        inputs = {"input_ids": tokens, "position_ids": positions}
        if images is not None:
            inputs.update(
                pixel_values=images.pixel_values.to(self.device, self.model.dtype), image_grid_thw=grid
            )
            self.num_images_encoded += int(images.image_grid_thw.shape[0])
        return inputs
