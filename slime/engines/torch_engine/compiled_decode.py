"""The batched runner's decode forward through `torch.compile` (`--enable-torch-compile`,
SGLang's flag, and `--torch-compile-max-bs`, its batch limit).

Eager, a decode step of a small model is dozens of kernels per layer, most of them tiny
elementwise ones (each RMSNorm is eight: casts, a square, a mean, rsqrt, products; the rotary
embedding about ten): on a GPU their fixed cost per launch, not the bytes they move, sets the
step time, CUDA graph or not. Inductor fuses the chains between the matrix products into a few
generated kernels. The CUDA graphs (slime.engines.torch_engine.cuda_graphs) then capture the
compiled code, so a replay launches those fused kernels.

Shapes: the batch's rows and the KV cache's rows and length are marked dynamic before the first
call, so one compiled graph serves every bucket of rows and every cache size (torch's duck
shaping, which would give two sizes that happen to be equal at that call one symbol and compile
again when they part, is off for these calls). The runner compiles at its start (`warm_up`),
before the engine serves: seconds on a CPU, likely tens of seconds on a GPU (not yet measured),
never in the middle of a rollout. Batches of one row run eagerly (torch specialises a size of 1,
which would compile again).

A compile that fails (no C compiler for Inductor, an operator it cannot trace) switches compiling
off for good with a warning naming the reason, and the step runs eagerly: the eager results, only
slower (`stats()['torch_compile_failed']`). An error in the compiled code's run itself (a kernel's
first launch, out of memory) is raised as the eager step's would be.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, int], torch.Tensor]


class CompiledDecode:
    """`forward(inputs [2, rows], key_len) -> logits`, compiled for batches of 2 to `max_bs` rows.

    Args:
        forward: the eager decode forward; must not synchronise with the host.
        max_bs: the most rows a compiled call takes.
    The tensors the forward reads whose sizes change (the KV cache's layer buffers) are marked
    with `mark_dynamic` whenever they are made.
    """

    def __init__(self, forward: Forward, max_bs: int):
        self.forward = forward
        self.max_bs = max_bs
        self._compiled: Forward | None = None
        self.failed: str | None = None
        """Why compiling failed (off from then on); None while it works."""
        self.blamed_for_capture = False
        """Whether a failed CUDA graph capture turned compiling off once (the runner's call)."""
        self.num_calls = 0

    def covers(self, rows: int) -> bool:
        return self.failed is None and 2 <= rows <= self.max_bs

    def __call__(self, inputs: torch.Tensor, key_len: int) -> torch.Tensor:
        if not self.covers(inputs.shape[1]):
            return self.forward(inputs, key_len)
        if self._compiled is None:
            self._compiled = torch.compile(self.forward)
        torch._dynamo.maybe_mark_dynamic(inputs, 1)
        try:
            with _fx_config().patch(use_duck_shape=False):
                out = self._compiled(inputs, key_len)
        except torch._dynamo.exc.TorchDynamoException as e:
            # tracing or code generation failed (Inductor's errors included); an error of the
            # step itself (out of memory, a kernel's) is raised again by the eager forward below
            self.failed = _reason(e)
            logger.warning(
                "--enable-torch-compile: compiling the decode step failed (%s); decoding eagerly", self.failed
            )
            return self.forward(inputs, key_len)
        self.num_calls += 1
        return out

    @staticmethod
    def mark_dynamic(buffers: list[torch.Tensor], dims: tuple[int, ...]) -> None:
        """Sizes `dims` of `buffers` change between calls: a compile takes them as dynamic."""
        for buf in buffers:
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(buf, dim)

    def warm_up(self, inputs: torch.Tensor, key_lens: tuple[int, ...]) -> None:
        """Compile now, on `inputs` (2 rows), once per key length given: a length that changes
        (over padded keys, a Python int) compiles again at its first change."""
        for key_len in key_lens:
            self(inputs, key_len)
        self.num_calls = 0

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"torch_compile_max_bs": self.max_bs, "torch_compile_calls": self.num_calls}
        if self.failed:
            out["torch_compile_failed"] = self.failed
        return out


def _fx_config() -> Any:
    """torch's symbolic-shape settings (a config module whose `patch` mypy cannot see)."""
    from torch.fx.experimental import _config

    return _config


def _reason(e: BaseException) -> str:
    """The first line of what went wrong: the backend's own error where Dynamo wraps one."""
    inner = getattr(e, "inner_exception", None) or e.__cause__ or e
    lines = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {lines[0] if lines else ''}"
