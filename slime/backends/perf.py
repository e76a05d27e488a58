"""A train call's throughput metrics (slime's `perf/*`): the wall time of its passes, each ended
only once the device has finished the pass's work, and the model's FLOPs (slime.utils.flops)."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from slime.utils import flops
from slime.utils.job_trace import RECORDER

logger = logging.getLogger(__name__)


class PassClock:
    """Wall seconds of named passes on one rank, summed by name.

    CUDA kernels run after the Python call that launched them returns, so each pass starts and
    ends with a synchronisation of the device: a pass is charged its own kernels, not the
    previous pass's, and all of them (the optimizer step's included, which nothing reads back).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}

    def _wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time pass `name` (also a span of the job's timeline, category "pass")."""
        self._wait()
        start, start_ns = time.perf_counter(), RECORDER.now_ns()
        yield
        self._wait()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        RECORDER.complete(name, start_ns, RECORDER.now_ns(), cat="pass")


class StepPerf:
    """An actor's FLOPs count and peak, and from them each train call's `perf/*` metrics."""

    def __init__(self, hf_config: Any, device: torch.device, peak_tflops: float | None, rank: int = 0):
        """`peak_tflops`: --peak-tflops (None: the GPU's from slime.utils.flops.PEAK_BF16_TFLOPS,
        none on a CPU or an unlisted GPU)."""
        self.hf_config, self.rank = hf_config, rank
        if peak_tflops is None and device.type == "cuda":
            peak_tflops = flops.peak_tflops(torch.cuda.get_device_name(device))
            if peak_tflops is None and rank == 0:
                logger.info(
                    "perf: no peak TFLOPS known for %s: perf/actor_train_mfu needs --peak-tflops",
                    torch.cuda.get_device_name(device),
                )
        self.peak = peak_tflops

    @functools.cached_property
    def model_flops(self) -> flops.ModelFlops | None:
        """The model's FLOPs count, from its config where slime.utils.flops knows the family, else
        from the active parameters of its text model built on the meta device (None: neither)."""
        try:
            counted = flops.from_config(self.hf_config)
        except (TypeError, ValueError, KeyError, IndexError) as e:  # a config missing a shape: count weights
            logger.warning("perf: the config's shapes cannot be counted (%s)", e)
            counted = None
        how = "from the config"
        if counted is None:
            counted = _count_parameters(self.hf_config)
            how = (
                "from its parameters (a family whose shapes are not counted: attention only in "
                "full-attention layers)"
            )
        if self.rank == 0 and counted is not None:
            logger.info("perf: %.3gB matmul weights per token, counted %s", counted.matmul_params / 1e9, how)
        return counted

    def metrics(self, seq_lens: Sequence[int], num_gpus: int, seconds: dict[str, float]) -> dict[str, float]:
        """The train call's perf metrics (slime.utils.flops.step_perf), named without `perf/`."""
        return flops.step_perf(self.model_flops, seq_lens, num_gpus, seconds, self.peak)


def _count_parameters(hf_config: Any) -> flops.ModelFlops | None:
    text = flops.text_config(hf_config)
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(text)
    except Exception as e:  # a family transformers cannot build as a causal LM: TFLOPS not reported
        logger.warning(
            "perf: no FLOPs count for model_type %s (%s); TFLOPS not reported",
            getattr(text, "model_type", "?"),
            e,
        )
        return None
    return flops.from_parameters(flops.active_parameters(model, text), text)
