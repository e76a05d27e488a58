"""The torch engine's runner interface (`Runner`: prefill, decode, release, free_cache) and the
generic runner: any Hugging Face causal LM, one `DynamicCache` per sequence, a batch-1 forward per
sequence and step (the model's own forward, so any layer kind runs exactly). The batched runner
is slime.engines.torch_engine.model_runner's; the vision-language runner derives from this one
(slime.engines.torch_engine.vision)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from slime.engines.torch_engine.sequence import Sequence


def lora_rows(adapters: Any, per_row: list[Any]) -> Any:
    """Context: the batch rows use these LoRA adapters (slime.engines.torch_engine.lora)."""
    if adapters is None or not any(a is not None for a in per_row):
        return contextlib.nullcontext()
    return adapters.rows(per_row)


TokenSource = tuple[torch.Tensor, list[int]]


class Runner:
    """Interface of both runners. `active` lists the sequences with KV state, in decode order."""

    active: list[Sequence]
    adapters: Any = None
    """The engine's served LoRA adapters (slime.engines.torch_engine.lora), with --enable-lora."""

    def _lora(self, seqs: list[Sequence]) -> Any:
        """Context: the next forward's batch rows are `seqs`, each with its LoRA adapter."""
        return lora_rows(self.adapters, [s.lora for s in seqs])

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Run the prompts of new sequences; return last-position logits (n, V) in float32."""
        raise NotImplementedError

    def decode(self, tokens_from: TokenSource | None = None) -> tuple[list[Sequence], torch.Tensor]:
        """One token for every active sequence; return them (in row order) and logits (B, V).
        `tokens_from`: the input tokens are still on the device (overlapped decoding,
        slime.engines.torch_engine.rounds): the previous step's token ids and, per active
        sequence in row order, its index there. Only the batched runner takes it."""
        raise NotImplementedError

    def release(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence's KV state."""
        raise NotImplementedError

    def free_cache(self) -> None:
        """Drop all cache memory (only valid with no active sequences)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget every sequence's KV state and free the cache: recovery after a failed step."""
        raise NotImplementedError

    def forget_graphs(self) -> None:
        """Drop captured CUDA graphs: the parameters' storage is about to change (memory release)."""

    def stats(self) -> dict[str, Any]:
        """Counters for /get_server_info."""
        return {}


class GenericRunner(Runner):
    """Any HF causal LM: a DynamicCache per sequence, batch-1 forwards."""

    def __init__(self, model: Any):
        self.model = model
        self.active: list[Sequence] = []
        self.device = next(model.parameters()).device

    def _step(self, seq: Sequence, ids: list[int]) -> torch.Tensor:
        from transformers import DynamicCache

        # From the config: a hybrid model (Qwen3-Next, Qwen3.5) keeps its linear-attention state in it too.
        cache = seq.runner_state.setdefault("hf_cache", DynamicCache(config=self.model.config))
        with self._lora([seq]):
            out = self.model(**self._inputs(seq, ids), past_key_values=cache, use_cache=True)
        seq.runner_state["hf_cache"] = out.past_key_values
        seq.num_cached += len(ids)
        return out.logits[0, -1].float()

    def _inputs(self, seq: Sequence, ids: list[int]) -> dict[str, Any]:
        """The forward's inputs for `seq`'s next `ids` (the vision runner adds pixels and positions)."""
        return {"input_ids": torch.tensor([ids], device=self.device)}

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        rows = [self._step(s, (s.prompt_ids + s.output_ids)[s.num_cached :]) for s in seqs]
        self.active.extend(seqs)
        return torch.stack(rows)

    @torch.inference_mode()
    def decode(self, tokens_from: TokenSource | None = None) -> tuple[list[Sequence], torch.Tensor]:
        assert tokens_from is None, "the generic runner decodes from host tokens only"
        seqs = list(self.active)
        return seqs, torch.stack([self._step(s, [s.last_token]) for s in seqs])

    def release(self, seq: Sequence) -> None:
        self.active.remove(seq)
        seq.runner_state.pop("hf_cache", None)

    def free_cache(self) -> None:
        assert not self.active, "free_cache with active sequences"

    def reset(self) -> None:
        for seq in self.active:
            seq.runner_state.pop("hf_cache", None)
        self.active.clear()
