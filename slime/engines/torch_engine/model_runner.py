"""All tensor work of the torch engine: loading the model, the KV cache, prefill and decode.

Two runners share one interface (`prefill`, `decode`, `release`, `free_cache`):

* `BatchedRunner`, for every family the registry (slime.utils.model_families) marks batched:
  decoders of attention layers (grouped-query or multi-latent: slime.engines.torch_engine.layers)
  or linear-attention layers (per-row states: slime.engines.torch_engine.linear_states), and MLP
  or MoE layers; drives the Hugging Face modules layer by layer with a slot KV cache. Running
  sequences occupy rows [0, B) of the cache; a finished sequence's row is refilled by the last
  row, so decode attends over a view of the cache with no gather. Prefill pads new prompts to
  the longest and writes their keys/values straight into fresh rows.
* `GenericRunner` (slime.engines.torch_engine.runner), for any other causal LM: one Hugging Face
  `DynamicCache` per sequence and a batch-1 forward per sequence and step. Slower, but correct
  for every architecture.

Both compute exactly the model's math (same modules, same rotary embedding), so float32
log-probs match a teacher-forced forward of the whole sequence.

Batch invariance (`--enable-deterministic-inference`): a batched matmul or attention may give
a row other low bits when the other rows (their number, their padded length) change, so a
sequence's log-probs would depend on what else the engine was running. In deterministic mode
the batched runner runs every sequence's prefill and decode as its own batch of one, with
keys exactly as long as its own context: its result depends on nothing else.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from slime.engines.torch_engine.attention import (
    LiveKernel,
    LiveRows,
    decode_attention,
    live_decode_attention,
    live_keys_kernel,
    prefill_attention_cuda,
    sdpa_masked,
)
from slime.engines.torch_engine.compiled_decode import CompiledDecode
from slime.engines.torch_engine.cuda_graphs import DecodeGraphs
from slime.engines.torch_engine.kv_cache import SlotKVCache
from slime.engines.torch_engine.layers import attention_kind, text_model
from slime.engines.torch_engine.linear_states import LinearStates
from slime.engines.torch_engine.routed_experts import RoutedExperts
from slime.engines.torch_engine.runner import GenericRunner, Runner, TokenSource, lora_rows
from slime.engines.torch_engine.sequence import Sequence
from slime.engines.torch_engine.shapes import DecodeShapes
from slime.utils import transfer
from slime.utils.model_families import BATCHED, FAMILIES, auto_model_class

logger = logging.getLogger(__name__)

# The families the batched runner knows (slime.utils.model_families: engine BATCHED). An MoE
# layer's router works token by token, so a padded batch routes each real token as it would
# alone (HF's experts have no capacity limit).
_BATCHED = {f.model_type for f in FAMILIES.values() if f.engine == BATCHED}


def load_model(model_path: str, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    model: Any = auto_model_class(config).from_pretrained(
        model_path, config=config, dtype=dtype, attn_implementation="sdpa"
    )
    model.to(device).eval().requires_grad_(False)
    return model


def fits_batched_runner(model: Any) -> bool:
    """True when the batched runner knows this architecture's layer layout."""
    if getattr(model.config, "model_type", None) not in _BATCHED:
        return False
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
    if any(t not in ("full_attention", "linear_attention") for t in layer_types):
        return False
    inner = text_model(model) if hasattr(model, "model") else None
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    attention = [getattr(layer, "self_attn", None) for layer in inner.layers]
    linear = [hasattr(layer, "linear_attn") for layer in inner.layers]
    if not all(a is not None or is_linear for a, is_linear in zip(attention, linear)) or all(linear):
        return False
    return all(getattr(a, "sliding_window", None) is None for a in attention)


def make_runner(
    model: Any,
    max_running: int,
    context_length: int,
    deterministic: bool = False,
    cuda_graph_max_bs: int | None = None,
    attention_backend: str = "auto",
    batched: type[BatchedRunner] | None = None,
    generic: Callable[[Any], Runner] = GenericRunner,
    torch_compile_max_bs: int = 0,
) -> Runner:
    """`cuda_graph_max_bs`: on CUDA, decode batches up to this many rows replay CUDA graphs (0: none,
    None: every batch). `torch_compile_max_bs`: decode batches up to this many rows run compiled
    (0: none). `attention_backend`: EngineConfig's (ValueError where `flash` cannot run).
    `batched` / `generic`: the runners' classes (a vision-language model's: slime.engines.
    torch_engine.vision)."""
    if not fits_batched_runner(model):
        if attention_backend == "flash":
            raise ValueError(
                f"--attention-backend flash: model_type {model.config.model_type!r} runs on the "
                "per-sequence runner, whose attention is transformers'; use auto"
            )
        if torch_compile_max_bs:
            logger.warning("--enable-torch-compile: the per-sequence runner decodes eagerly")
        logger.info("model_type %r: using the generic per-sequence runner", model.config.model_type)
        return generic(model)
    runner = (batched or BatchedRunner)(
        model,
        max_running,
        context_length,
        deterministic,
        cuda_graph_max_bs=cuda_graph_max_bs,
        live_keys=False if attention_backend == "torch_native" else None,
        torch_compile_max_bs=torch_compile_max_bs,
    )
    if attention_backend == "flash" and runner.kind.value_dim is not None:
        raise ValueError("--attention-backend flash: multi-latent attention reads padded keys; use auto")
    if attention_backend == "flash" and runner.live_keys is None:
        raise ValueError(
            "--attention-backend flash needs CUDA, --dtype bfloat16 or float16, an Ampere or newer GPU, a "
            "head dimension that is a multiple of 8 up to 256, a torch whose flash kernel takes "
            "seqused_k, and no --enable-deterministic-inference; use auto or torch_native"
        )
    return runner


class BatchedRunner(Runner):
    """Continuous-batching runner for the decoder stacks of the module docstring.

    On CUDA (and not deterministic) decode shapes are bucketed (slime.engines.torch_engine.shapes),
    attention builds no per-shape plan (slime.engines.torch_engine.attention), a step's inputs go
    up without waiting and its tokens come down in one copy (slime.utils.transfer),
    and decode batches of up to `cuda_graph_max_bs` rows replay CUDA graphs. `bucket_shapes`
    overrides the bucketing choice (tests run the CUDA shapes on CPU).
    """

    multimodal_rope = False
    """Whether rows carry rotary offsets (`rope_offsets`: a vision-language subclass's)."""

    def __init__(
        self,
        model: Any,
        max_running: int,
        context_length: int,
        deterministic: bool = False,
        bucket_shapes: bool | None = None,
        cuda_graph_max_bs: int | None = None,
        live_keys: LiveKernel | bool | None = None,
        torch_compile_max_bs: int = 0,
    ):
        """`live_keys`: decode attention reads only each row's live keys with this kernel
        (slime.engines.torch_engine.attention.live_decode_attention) over a token-major cache;
        None: the flash kernel where it runs (never in deterministic mode); False: padded keys.
        `torch_compile_max_bs`: decode batches of 2 up to this many rows run through torch.compile
        (slime.engines.torch_engine.compiled_decode; 0: none)."""
        self.model = model
        self.deterministic = deterministic
        self.inner: Any = text_model(model)
        config = model.config.get_text_config()
        self.num_heads = config.num_attention_heads
        # Hybrid models (Qwen3-Next, Qwen3.5): linear-attention layers keep per-row states of their
        # own (slime.engines.torch_engine.linear_states); the KV cache holds the attention layers'.
        linear = [li for li, layer in enumerate(self.inner.layers) if hasattr(layer, "linear_attn")]
        attention = [li for li in range(len(self.inner.layers)) if li not in linear]
        self.cache_index = {li: i for i, li in enumerate(attention)}
        self.states = LinearStates(max_running) if linear else None
        first_attn = self.inner.layers[attention[0]].self_attn
        self.head_dim = getattr(first_attn, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = getattr(first_attn, "scaling", self.head_dim**-0.5)
        self.kind = attention_kind(first_attn, self.num_heads, self.head_dim)
        self.unapplied_linears = self.kind.unapplied
        """Linear layers this runner computes without calling them (no LoRA hook runs)."""
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        latent = self.kind.value_dim is not None  # the flash kernel reads values as wide as keys
        if live_keys is None and not deterministic and not latent:
            live_keys = live_keys_kernel(self.device, self.dtype, self.head_dim)
        self.live_keys: LiveKernel | None = live_keys if callable(live_keys) else None
        self.cache = SlotKVCache(
            len(attention),
            self.kind.cache_heads,
            self.kind.key_dim,
            self.dtype,
            self.device,
            max_running,
            context_length,
            token_major=self.live_keys is not None,
            values_in_keys=self.kind.value_dim,
        )
        self.active: list[Sequence] = []
        on_cuda = self.device.type == "cuda"
        bucketed = on_cuda and not deterministic if bucket_shapes is None else bucket_shapes
        self.shapes = DecodeShapes(bucketed, max_running, context_length)
        self.rope_offsets: torch.Tensor | None = None
        """Per row, what its rotary positions add to its token positions (a vision prompt's delta)."""
        if self.multimodal_rope:  # made before the decode step compiles, which reads it
            rows = self.shapes.rows(max_running)
            self.rope_offsets = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.decode_shapes: collections.Counter[tuple[int, int]] = collections.Counter()
        """Decode steps run per (batch rows, key length) bucket (counted when shapes are bucketed)."""
        # Mixture-of-experts layers: their routers, and what they chose for the sequences that ask.
        self.experts = RoutedExperts(self.inner.layers)
        self.routers = self.experts.routers
        self._set_up_fast_decode(on_cuda and bucketed, max_running, cuda_graph_max_bs, torch_compile_max_bs)

    def _set_up_fast_decode(
        self, graphable: bool, max_running: int, cuda_graph_max_bs: int | None, torch_compile_max_bs: int
    ) -> None:
        """CUDA graphs (`graphable`: CUDA, bucketed shapes) and torch.compile, for dense models:
        HF's expert routing synchronises with the host (told by structure, not by the router's
        class, which changed between transformers releases); delta-nets are not captured yet."""
        experts = any(hasattr(getattr(layer, "mlp", None), "experts") for layer in self.inner.layers)
        plain = not experts and not self.routers and self.states is None
        self.graphs: DecodeGraphs | None = None
        if graphable and plain and cuda_graph_max_bs != 0:
            max_batch = min(cuda_graph_max_bs or max_running, max_running)
            self.graphs = DecodeGraphs(self._graph_forward, max_batch, self.shapes.rows(max_batch))
        self._graphs_generation = self.cache.generation
        # not where each sequence decodes alone (deterministic mode)
        self.compiled: CompiledDecode | None = None
        widest = min(torch_compile_max_bs, max_running)  # (batches of one row decode eagerly)
        if widest >= 2 and plain and not self.deterministic:
            self.compiled = CompiledDecode(self._decode_forward, widest)
            self._compile_now()
        elif torch_compile_max_bs:
            logger.warning(
                "--enable-torch-compile: this engine's decode runs eagerly (mixture-of-experts or "
                "linear-attention layers, --enable-deterministic-inference, or one request at a time)"
            )

    def _reserve(self, rows: int, length: int) -> None:
        """Room in the KV cache (and a hybrid's linear-attention states) for `rows` x `length`;
        a compiled forward takes new buffers' rows and length as dynamic sizes."""
        generation = self.cache.generation
        self.cache.ensure(rows, length)
        if self.compiled is not None and self.cache.generation != generation:
            dims = (0, 1) if self.cache.token_major else (0, 2)
            self.compiled.mark_dynamic(self.cache.k + self.cache.v, dims)
        if self.states is not None:
            self.states.ensure(rows)

    def _forward(
        self,
        ids_BT: torch.Tensor,
        pos_BT: torch.Tensor,
        attend: Callable[..., torch.Tensor],
        rows: slice,
        write_pos_B: torch.Tensor | None,
        last_index_B: torch.Tensor,
    ) -> torch.Tensor:
        """The decoder stack over `ids_BT`, keys/values into cache `rows`. Prefill (`write_pos_B`
        None): `attend(q, keys, values)` over the prompts' own keys; decode: `attend(q, layer)`
        over the layer's cache. Returns float32 logits at `last_index_B`."""
        h = self.inner.embed_tokens(ids_BT)
        cos, sin = self.inner.rotary_emb(h, pos_BT)
        B = ids_BT.shape[0]
        row_index = torch.arange(rows.start, rows.stop, device=self.device)
        for li, layer in enumerate(self.inner.layers):
            x = layer.input_layernorm(h)
            ci = self.cache_index.get(li)
            if ci is None:  # a linear-attention layer, on its rows' states
                assert self.states is not None
                a = layer.linear_attn(x, cache=self.states.of(rows, prefill=write_pos_B is None))
            else:
                q, k, v, extra = self.kind.qkv(layer.self_attn, x, cos, sin)
                if write_pos_B is None:  # prefill: fresh rows, positions [0, T)
                    self.cache.write_prefill(ci, rows, k, v)
                    out = attend(q, k, v)
                else:  # decode: one new position per row
                    self.cache.write_decode(ci, row_index, write_pos_B, k, v)
                    out = attend(q, ci)
                a = self.kind.output(layer.self_attn, out, extra)
            sandwich = getattr(layer, "post_self_attn_layernorm", None)  # GLM-4: each output normed
            h = h + (a if sandwich is None else sandwich(a))
            m = layer.mlp(layer.post_attention_layernorm(h))
            h = h + (m if sandwich is None else layer.post_mlp_layernorm(m))
        last = h[torch.arange(B, device=self.device), last_index_B]
        return self.model.lm_head(self.inner.norm(last)).float()

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        if self.deterministic or self.states is not None:  # (linear layers: no right padding)
            return torch.cat([self._prefill([s]) for s in seqs])
        return self._prefill(seqs)

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        start = len(self.active)
        lengths = [s.num_tokens for s in seqs]
        T = max(lengths)
        self._reserve(start + len(seqs), T)
        host = torch.zeros((len(seqs), T + 1), dtype=torch.long)  # each row: its ids, then its length
        for i, s in enumerate(seqs):
            host[i, : lengths[i]] = torch.tensor(s.prompt_ids + s.output_ids)
            host[i, T] = lengths[i]
        uploaded = transfer.to_device(host, self.device)
        ids, lens = uploaded[:, :T], uploaded[:, T]
        self.experts.begin(seqs)
        pos = torch.arange(T, device=self.device)
        if self.device.type == "cuda":  # causal alone keeps right padding out of real positions
            attend = functools.partial(prefill_attention_cuda, scale=self.scaling)
        else:  # causal within each prompt and blind to padding keys: (n, 1, T, T)
            mask = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lens[:, None, None])
            attend = functools.partial(sdpa_masked, mask=mask[:, None], scale=self.scaling)
        with self._lora(seqs):
            logits = self._forward(
                ids, pos[None].expand(len(seqs), T), attend, slice(start, start + len(seqs)), None, lens - 1
            )
        self.experts.keep_prefill(seqs, lengths, T)
        for s, n in zip(seqs, lengths):
            s.num_cached = n
        self.active.extend(seqs)
        return logits

    @torch.inference_mode()
    def decode(self, tokens_from: TokenSource | None = None) -> tuple[list[Sequence], torch.Tensor]:
        seqs = list(self.active)
        longest = max(s.num_cached for s in seqs) + 1
        self._reserve(self.shapes.rows(len(seqs)), self.shapes.keys(longest))
        if self.deterministic:
            assert tokens_from is None, "deterministic decoding does not overlap"
            logits = torch.cat([self._decode(seqs[i : i + 1], i) for i in range(len(seqs))])
        else:
            logits = self._decode(seqs, 0, tokens_from)
        for s in seqs:
            s.num_cached += 1
        return seqs, logits

    def _decode(
        self, seqs: list[Sequence], first_row: int, tokens_from: TokenSource | None = None
    ) -> torch.Tensor:
        """One token for `seqs`, the cache rows from `first_row` on (padded to a bucket of rows
        when shapes are bucketed: the padding rows lie past the active ones)."""
        B = len(seqs)
        rows = self.shapes.rows(B) if first_row == 0 else B
        # (Overlapped decoding feeds a sequence once more after its last token; that position is
        # still inside the context: prompt + max_new_tokens <= context length.)
        positions = [s.num_cached for s in seqs]
        # Live keys: the kernel reads each row's own; the graph's shape is the cache's length.
        key_len = self.cache.length if self.live_keys else self.shapes.keys(max(positions) + 1)
        # Row 0: token ids (or, with tokens_from, their index in the previous step's); row 1:
        # positions. Padding rows: token 0 (index 0) at position 0.
        host = torch.zeros((2, rows), dtype=torch.long)
        host[0, :B] = torch.tensor(tokens_from[1] if tokens_from else [s.last_token for s in seqs])
        host[1, :B] = torch.tensor(positions)
        inputs = transfer.to_device(host, self.device)
        if tokens_from is not None:
            inputs = torch.stack((tokens_from[0].index_select(0, inputs[0]), inputs[1]))
        if self.shapes.bucketed:  # exact shapes would grow this without bound
            self.decode_shapes[(rows, key_len)] += 1
        record = self.experts.begin(seqs)
        if self._graph_ready(seqs, first_row, record):
            assert self.graphs is not None
            logits = self.graphs.run(inputs, key_len)
            self._graphs_without_compile()
        elif self.compiled is not None and not first_row and not record and not self._lora_in(seqs):
            logits = self.compiled(inputs, key_len)
        else:  # padding rows run the base model
            with lora_rows(self.adapters, [s.lora for s in seqs] + [None] * (rows - B)):
                logits = self._decode_forward(inputs, key_len, first_row)
        self.experts.append_decode(seqs, rows)
        return logits[:B]

    def _decode_forward(self, inputs: torch.Tensor, key_len: int, first_row: int = 0) -> torch.Tensor:
        """inputs [2, rows]: token ids and positions. No host synchronisation (CUDA-graph safe)."""
        rows = inputs.shape[1]
        ids, positions = inputs[0], inputs[1]
        rotary = positions if self.rope_offsets is None else positions + self.rope_offsets[first_row:][:rows]
        cache, live = self.cache, self.live_keys
        if live is not None:
            # the length from the buffer's shape, not the int attribute: a compiled forward takes
            # it as a dynamic size rather than compiling again whenever the cache grows
            live_rows = LiveRows.of(positions, first_row, cache.k[0].shape[1])

            def attend(q: torch.Tensor, li: int) -> torch.Tensor:
                return live_decode_attention(q, cache.k[li], cache.v[li], live_rows, self.scaling, live)
        else:
            mask = (torch.arange(key_len, device=self.device)[None, :] <= positions[:, None])[
                :, None, None, :
            ]
            kernel = decode_attention if self.device.type == "cuda" else sdpa_masked

            def attend(q: torch.Tensor, li: int) -> torch.Tensor:
                k, v = cache.view(li, slice(first_row, first_row + rows), key_len)
                return kernel(q, k, v, mask=mask, scale=self.scaling)

        zeros = torch.zeros(rows, dtype=torch.long, device=self.device)
        return self._forward(
            ids[:, None], rotary[:, None], attend, slice(first_row, first_row + rows), positions, zeros
        )

    @torch.inference_mode()
    def _compile_now(self) -> None:
        """Compile the decode forward before serving, on two rows of an empty cache (their keys
        are written to rows no sequence holds; the cache is freed after). Over padded keys, at
        the key lengths that compile apart: 1 (torch specialises it), another, and the whole cache
        (whose view is the whole buffer)."""
        assert self.compiled is not None
        self._reserve(2, self.shapes.keys(4))
        inputs = torch.zeros((2, 2), dtype=torch.long, device=self.device)
        whole = self.cache.length
        key_lens = (whole,) if self.live_keys else (self.shapes.keys(1), self.shapes.keys(4), whole)
        self.compiled.warm_up(inputs, key_lens)
        self.free_cache()

    def _graph_forward(self, inputs: torch.Tensor, key_len: int) -> torch.Tensor:
        return (self.compiled or self._decode_forward)(inputs, key_len)

    def _graphs_without_compile(self) -> None:
        """A CUDA graph of the compiled forward that failed to capture: compiling goes off and
        the graphs capture the eager forward from the next step (graphs matter more than fusion).
        If the eager capture fails too, compiling was not the cause: it comes back on, graphs
        stay off."""
        graphs, compiled = self.graphs, self.compiled
        if graphs is None or graphs.failed is None or compiled is None:
            return
        if compiled.failed is None and not compiled.blamed_for_capture:
            compiled.failed = f"a CUDA graph of the compiled decode step failed to capture ({graphs.failed})"
            compiled.blamed_for_capture = True
            logger.warning("--enable-torch-compile: %s; graphs capture the eager step", compiled.failed)
            graphs.failed = None
        elif compiled.failed is not None and compiled.blamed_for_capture:
            logger.warning("the eager decode step failed to capture too: compiling is back on")
            compiled.failed = None

    def _lora_in(self, seqs: list[Sequence]) -> bool:
        """Whether one of `seqs` decodes with an adapter (the LoRA hooks choose adapters per row
        in Python: neither a CUDA graph nor a compiled forward holds them)."""
        return self.adapters is not None and any(s.lora is not None for s in seqs)

    def _graph_ready(self, seqs: list[Sequence], first_row: int, record: bool) -> bool:
        """Whether this step replays a CUDA graph (dropping graphs made stale by a cache regrow)."""
        if self.graphs is None or first_row or record or not self.graphs.covers(len(seqs)):
            return False
        if self._lora_in(seqs):
            return False
        if self._graphs_generation != self.cache.generation:
            self.graphs.clear()
            self._graphs_generation = self.cache.generation
        return True

    @torch.inference_mode()
    def release(self, seq: Sequence) -> None:
        row = self.active.index(seq)
        last = len(self.active) - 1
        if row != last:
            moved = self.active[last]
            self.cache.move_row(last, row, moved.num_cached)
            if self.states is not None:
                self.states.move_row(last, row)
            if self.rope_offsets is not None:
                self.rope_offsets[row] = self.rope_offsets[last]
            self.active[row] = moved
        self.active.pop()

    def free_cache(self) -> None:
        assert not self.active, "free_cache with active sequences"
        self.forget_graphs()
        self.cache.free()
        if self.states is not None:
            self.states.free()

    def reset(self) -> None:
        self.active.clear()
        self.free_cache()

    def forget_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "decode_shapes": len(self.decode_shapes),
            "bucketed_shapes": self.shapes.bucketed,
            "decode_attention": "live keys" if self.live_keys is not None else "padded keys",
        }
        if self.graphs is not None:
            out.update(
                cuda_graphs=self.graphs.num_graphs,
                cuda_graph_replays=self.graphs.num_replays,
                cuda_graph_capture_seconds=round(self.graphs.capture_seconds, 3),
            )
            if self.graphs.failed:
                out["cuda_graph_failed"] = self.graphs.failed
        if self.compiled is not None:
            out.update(self.compiled.stats())
        return out
