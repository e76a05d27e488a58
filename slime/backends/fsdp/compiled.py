"""`--fsdp-torch-compile`: the decoder layers' forwards through torch.compile.

Eager, a decoder layer's forward and backward over a packed micro-batch is a few matrix products
and dozens of elementwise kernels over [tokens, hidden] or [tokens, intermediate] activations
(each RMSNorm is eight in float32, the rotary embedding about ten, SiLU and its product, the
residual sums, and as many again in backward): at a 0.6B model's widths they move about as many
bytes as the matrix products take time. Inductor fuses each chain between two matrix products
into one generated kernel, forward and backward (AOTAutograd), as torchtitan compiles each
transformer block under FSDP2.

How: each layer's `forward` is replaced by its class's compiled forward. FSDP2's hooks
(all-gather before, reshard after, the gradient reduce-scatter) stay outside it, in the module's
call; the layers of a class share its compiled graphs (their parameters are the graphs' inputs,
not constants), so 28 layers compile as often as one. The attention kernel itself
(slime.backends.packed_attention) stays out of the graphs: a single kernel already, whose
packed-sample bounds are host-side Python values, so a layer compiles in pieces, for training and
for the no-grad passes apart. The token axis of a layer's inputs is marked dynamic, so that the
micro-batches' changing lengths reuse the graphs; at the second step a few pieces compile once
more, with a dynamic length, and later steps compile nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


RECOMPILE_LIMIT = 64
"""Compiles one function may keep (torch's default: 8): a layer's pieces between graph breaks
compile for training and for the no-grad passes, static then with a dynamic length, and
transformers' checkpointing wrapper wraps FSDP's layer class around the model's (each wrapper a
variant). Past the limit torch would run the rest eagerly."""


def compile_layers(layers: list[torch.nn.Module]) -> None:
    """Replace each layer's forward by its compiled form (the module and its state-dict names stay)."""
    if not layers:
        return
    config: Any = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    compiled: dict[type, Any] = {}  # one per layer class (a model may mix kinds of layers)
    for layer in layers:
        if type(layer) not in compiled:
            compiled[type(layer)] = _naming_the_flag(torch.compile(type(layer).forward), type(layer).__name__)
        layer.forward = compiled[type(layer)].__get__(layer)
        layer.register_forward_pre_hook(_token_axis_dynamic, with_kwargs=True)
    logger.info("--fsdp-torch-compile: %d decoder layers compile at their first forward", len(layers))


class CompileFailed(RuntimeError):
    """torch.compile could not build a layer's kernels (Inductor's compiler missing or failing)."""


def _naming_the_flag(forward: Any, layer: str) -> Any:
    """`forward` (compiled), whose compiler's failure at the first step names the flag and the fix
    instead of ending the step with torch's error alone (still chained below it)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            reason = str(e).strip().splitlines()[0]
            raise CompileFailed(
                f"--fsdp-torch-compile: torch.compile could not build the kernels of {layer}: "
                f"{reason}. Run without --fsdp-torch-compile, or fix what torch names."
            ) from e

    return call


def _token_axis_dynamic(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Mark the token axis of a layer's inputs dynamic before the first compile, so that it is not
    compiled for the first micro-batch's length and again at the second's: the hidden states
    [batch, tokens, hidden], the rotary cos and sin [batch, tokens, dim], the position ids
    [batch, tokens] and the packed samples' bounds [samples + 1]."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    rotary = kwargs.get("position_embeddings") or ()
    for t in (hidden, kwargs.get("position_ids"), *rotary):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            torch._dynamo.maybe_mark_dynamic(t, 1)
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if isinstance(kwargs.get(name), torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(kwargs[name], 0)
