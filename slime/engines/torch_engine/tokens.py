"""The torch engine's tokenizer, shared by the threads that use it.

Worker threads encode prompts while the engine thread decodes answers; a fast tokenizer is not
safe to share across threads ("Already borrowed"), so every use goes through one lock. The event
loop never takes it: the server encodes and decodes in worker threads.
"""

from __future__ import annotations

import threading
from typing import Any

from slime.engines.torch_engine.stop_watch import StopWatch


class SharedTokenizer:
    def __init__(self, model_path: str, model: Any):
        """The tokenizer of the checkpoint at `model_path`; `model`'s configs name its end tokens."""
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._lock = threading.Lock()
        self.eos_token_ids = _eos_token_ids(model, self.tokenizer)
        """Every id that ends a sequence: the generation config's, the model config's, the tokenizer's."""

    def encode(self, text: str) -> list[int]:
        """Tokenize a text prompt as SGLang does: with the tokenizer's special tokens (e.g. BOS)."""
        with self._lock:
            return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def watch_stops(self, stops: tuple[str, ...], skip_special_tokens: bool) -> StopWatch:
        """One sequence's StopWatch. A fast tokenizer's tokens decode with its Rust decoder alone
        (about 1 us a call against 4-10 us through the Python wrapper, which adds only the space
        cleanup, that the watch applies itself; transformers skips that cleanup for BPE models, so
        there the watch may see a stop string that the output lacks: a full decode that finds
        none, not a stop)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        decode_ids = self.tokenizer.decode if backend is None else backend.decode
        clean_up = (
            self.tokenizer.clean_up_tokenization if self.tokenizer.clean_up_tokenization_spaces else None
        )

        def decode(ids: list[int]) -> str:
            with self._lock:
                return str(decode_ids(ids, skip_special_tokens=skip_special_tokens))

        return StopWatch(decode, stops, clean_up)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text, special tokens included (SGLang's return_text_in_logprobs)."""
        with self._lock:
            return [
                str(t) for t in self.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
            ]


def _eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
