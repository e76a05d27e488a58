"""Run megatron-core's model and pipeline schedules on CPU (gloo), for `--device cpu`.

megatron-core (0.16) is written for CUDA: its modules allocate with `device=torch.cuda.current_device()` or
`device="cuda"` (the rotary table, the default causal mask, the attention's scratch buffer, the pipeline's
shape exchange, the schedules' token count), call `torch.cuda.synchronize()`, fork dropout's random state on
the CUDA generator, and move a tied embedding's pipeline copy with `Tensor.cuda()`. None of it is a GPU
kernel: every operation has a CPU equivalent. `enable()` therefore gives each loaded `megatron.core` module a
view of torch in which those allocations land on the CPU and the CUDA calls are no-ops, replaces the CUDA
random-state tracker with one that keeps its named states for the CPU generator (`seed` seeds them as
megatron-core does on a GPU; activation recompute saves and restores the CPU generator and those states), and
makes `Tensor.cuda()` the identity while the model ties its embeddings. Nothing outside `megatron.core`
changes, nothing changes on a machine with CUDA (the actor calls this only for `--device cpu`), and the
numerics are megatron-core's own.

What this cannot give: anything that really needs a GPU (Transformer Engine, fused kernels,
megatron-core's own optimizer and DDP buffers, which check tensor types by their CUDA names).
The Megatron actor uses slime's AdamW and its own data-parallel reduction on every device, so
the code that runs here is the code that runs on a GPU.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn")


def _on_cpu(kwargs: dict[str, Any]) -> dict[str, Any]:
    device = kwargs.get("device")
    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
        kwargs["device"] = "cpu"
    return kwargs


class _NoStream:
    """A CUDA stream (and event) on the CPU: waiting and synchronising are no-ops."""

    def wait_stream(self, other: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, *args: Any) -> _NoStream:
        return self  # an event with the one method callers use on it: synchronize()


_THE_STREAM = _NoStream()


class _CudaOnCpu:
    """torch.cuda as megatron-core sees it: the current device is the CPU, syncs are no-ops."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    # The MoE all-to-all dispatcher copies token counts to the host on a side stream: on the CPU
    # there is one stream, and every copy is already synchronous.
    Stream = _NoStream

    @staticmethod
    def current_stream(*args: Any, **kwargs: Any) -> _NoStream:
        return _THE_STREAM

    @staticmethod
    def stream(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class _TorchOnCpu(types.ModuleType):
    """torch as megatron-core sees it: tensor factories put "cuda" tensors on the CPU."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _torch_view() -> types.ModuleType:
    view = _TorchOnCpu("torch")
    for name in _FACTORIES:
        factory = getattr(torch, name)
        setattr(view, name, lambda *a, _f=factory, **k: _f(*a, **_on_cpu(k)))
    return view


def enable() -> int:
    """Point every loaded megatron.core module at the CPU view of torch; returns how many.

    Imports the megatron-core modules the model's forward and backward use first (their `torch`
    global is replaced; modules imported later keep the real torch)."""
    import megatron.core.models.gpt.gpt_model
    import megatron.core.pipeline_parallel.p2p_communication
    import megatron.core.pipeline_parallel.schedules
    import megatron.core.transformer.dot_product_attention
    import megatron.core.transformer.moe.experts
    import megatron.core.transformer.moe.moe_layer
    import megatron.core.transformer.moe.router
    import megatron.core.transformer.moe.token_dispatcher  # noqa: F401
    from megatron.core.tensor_parallel import random as mc_random

    view = _torch_view()
    count = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = view  # type: ignore[attr-defined]
            count += 1

    mc_random._CUDA_RNG_STATE_TRACKER = _cpu_rng_tracker(mc_random)()
    mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recompute saves and restores the CUDA generator's state beside the CPU one.
    mc_random._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mc_random._set_cuda_rng_state = lambda *a, **k: None
    _keep_tied_embedding_on_cpu()
    _host_copies_as_on_gpu()
    return count


def _host_copies_as_on_gpu() -> None:
    """The MoE all-to-all dispatcher copies its split sizes to the host as numpy arrays
    (`maybe_move_tensor_to_cpu(..., as_numpy=True)`), which torch.distributed takes as lists of
    ints. That helper copies CUDA tensors only, so on the CPU the sizes would stay tensors, which
    all_to_all_single refuses: give the dispatcher a helper that converts CPU tensors too."""
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu
    if getattr(original, "_slime_cpu", False):
        return

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    to_host._slime_cpu = True  # type: ignore[attr-defined]
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _cpu_rng_tracker(mc_random: Any) -> type:
    class CpuRngTracker(mc_random.CudaRNGStatesTracker):
        """megatron-core's named random states, kept for the CPU generator: a dropout region runs
        on its name's state, which then advances to the next region, and the default stream is
        left where it was. (torch.random.fork_rng alone would also put the region's state back,
        so every forward would draw the same dropout masks.)"""

        def add(self, name: str, seed: int) -> None:
            if name in self.states_ or seed in self.seeds_:
                raise RuntimeError(f"random state {name!r} (seed {seed}) is already tracked")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mc_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise RuntimeError(f"random state {name!r} is not tracked: call cpu_shim.seed(...) first")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRngTracker


def seed(base: int, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """megatron-core's model_parallel_cuda_manual_seed for the CPU generator's named states: the
    tensor-parallel state differs per tensor-parallel rank, with megatron-core's seed offsets. (The
    default stream, dropout outside tensor-parallel regions, is the actor's torch.manual_seed:
    the same --seed on every rank.)"""
    from megatron.core.tensor_parallel import random as mc_random

    tracker = mc_random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    tracker.add(mc_random._DATA_PARALLEL_RNG_TRACKER_NAME, base)
    tracker.add(mc_random._MODEL_PARALLEL_RNG_TRACKER_NAME, base + 2718 + tp_rank)
    tracker.add(mc_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, base + 1024 + 100 * ep_rank + etp_rank)


def _keep_tied_embedding_on_cpu() -> None:
    """With tied embeddings and PP > 1 the model's constructor moves the last stage's copy of the
    embedding to the GPU (`weight.data.cuda()`) to all-reduce it with the first stage's: run it
    with Tensor.cuda as the identity for the duration of that one call."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer
    if getattr(original, "_slime_cpu", False):
        return

    def setup(self: Any) -> None:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # type: ignore[method-assign]
        try:
            original(self)
        finally:
            torch.Tensor.cuda = cuda  # type: ignore[method-assign]

    setup._slime_cpu = True  # type: ignore[attr-defined]
    LanguageModule.setup_embeddings_and_output_layer = setup  # type: ignore[method-assign]
