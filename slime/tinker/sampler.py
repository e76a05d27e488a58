"""Tinker's sampling clients on the project's torch engine: one engine process per base model
(`python -m slime.engines.torch_engine --enable-lora`, started at the first sampling session of
that model), each saved checkpoint served as a LoRA adapter loaded from its PEFT directory, so a
sampler always samples exactly the weights saved (a base-model sampler uses none).

A sample request (`asample`) becomes one SGLang /generate of `num_samples` copies of the prompt:

- `max_tokens`, `temperature`, `top_k` (-1: off), `top_p` as SGLang's; `seed` s gives sample i
  the seed s + i (the same seed, the same samples);
- `stop`: token ids, or strings; absent: the model's end-of-sequence token; an empty list: no
  stop at all, the end-of-sequence token included;
- the sampled tokens' log-probs always; with `prompt_logprobs` the prompt's, NaN at position 0
  (nothing predicts the first token).

The answer is the SDK's SampleResponse protobuf: per sample its tokens (int32), log-probs
(float32) and stop reason (stop or length).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from slime.tinker import wire
from slime.tinker.errors import TinkerNotFound, TinkerUserError
from slime.tinker.trainer import base_config

logger = logging.getLogger(__name__)

KEEP_LOADED = 8
"""Adapters an engine keeps loaded (Samplers._load)."""


@dataclass
class Sampler:
    sampler_id: str
    session_id: str
    base_model: str
    model_path: str | None
    checkpoint: str | None
    """The checkpoint's directory (None: the base model)."""


@dataclass(frozen=True)
class SampleRequest:
    tokens: list[int]
    num_samples: int
    params: dict[str, Any]
    prompt_logprobs: bool

    @classmethod
    def parse(cls, body: dict[str, Any]) -> SampleRequest:
        tokens: list[int] = []
        for chunk in (body.get("prompt") or {}).get("chunks") or []:
            if chunk.get("type") != "encoded_text":
                raise TinkerUserError(
                    f"a prompt chunk of type {chunk.get('type')!r} is not served here (text only)"
                )
            tokens.extend(int(t) for t in chunk.get("tokens") or [])
        if not tokens:
            raise TinkerUserError("sample: the prompt holds no tokens")
        n = body.get("num_samples", 1)
        if not isinstance(n, int) or n < 1:
            raise TinkerUserError(f"num_samples must be an int >= 1, got {n!r}")
        unsupported = [
            k for k in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k") if body.get(k)
        ]
        unsupported += [
            k for k in ("target_prompt_logprobs", "prompt_logprobs_last_n") if body.get(k) is not None
        ]
        if unsupported:
            raise TinkerUserError(f"sample: {', '.join(unsupported)} is not built on this server")
        return cls(
            tokens, n, sglang_params(body.get("sampling_params") or {}), bool(body.get("prompt_logprobs"))
        )


def sglang_params(p: dict[str, Any]) -> dict[str, Any]:
    """SGLang's sampling_params of Tinker's (module docstring); the seed is added per sample."""
    out: dict[str, Any] = {
        "temperature": p.get("temperature", 1.0),
        "top_p": p.get("top_p", 1.0),
        "top_k": p.get("top_k", -1),
    }
    if p.get("max_tokens") is not None:
        out["max_new_tokens"] = p["max_tokens"]
    stop = p.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop == []:
        out["ignore_eos"] = True
    elif stop and all(isinstance(s, int) for s in stop):
        out["stop_token_ids"] = list(stop)
    elif stop:
        if not all(isinstance(s, str) for s in stop):
            raise TinkerUserError(f"sampling_params.stop {stop!r}: token ids or strings, not both")
        out["stop"] = list(stop)
    if p.get("seed") is not None:
        out["seed"] = p["seed"]
    return out


class Samplers:
    """The sampling sessions and the engines behind them."""

    def __init__(self, bases: dict[str, str], device: str, log_dir: str):
        self.bases, self.device, self.log_dir = bases, device, log_dir
        self.sessions: dict[str, Sampler] = {}
        self._engines: dict[str, asyncio.Task[Any]] = {}
        self._loaded: dict[tuple[str, str], str] = {}
        """(base model, adapter directory @ its files' version) -> its name in that base's engine,
        least recently used first."""
        self._in_use: collections.Counter[str] = collections.Counter()  # by engine name
        self._names = itertools.count()
        self._lock = asyncio.Lock()

    def engine(self, base: str) -> asyncio.Task[Any]:
        """The engine of `base` (started now in the background if it is not)."""
        if base not in self._engines:
            from slime.engines.torch_engine.launcher import start_torch_engine

            args = ["--enable-lora", "--dtype", "float32", "--device", self.device, "--num-threads", "1"]
            args += ["--parent-pid", str(os.getpid())]  # a SIGKILLed server leaves no engine behind
            log = os.path.join(self.log_dir, f"engine-{len(self._engines)}.log")
            start = asyncio.to_thread(start_torch_engine, self.bases[base], args, log)
            task = asyncio.get_running_loop().create_task(start)
            # a start that failed is tried again by the next sampler (the error goes to its samples)
            task.add_done_callback(lambda t: t.exception() is not None and self._engines.pop(base, None))
            self._engines[base] = task
        return self._engines[base]

    async def close(self) -> None:
        """Stop the engines (those still starting once started)."""
        for task in self._engines.values():
            try:
                proc = await task
            except Exception:
                continue
            await asyncio.to_thread(proc.stop)

    def drop_session(self, session_id: str) -> None:
        for sampler_id in [k for k, v in self.sessions.items() if v.session_id == session_id]:
            del self.sessions[sampler_id]

    def create(
        self, session_id: str, seq: Any, base: str, model_path: str | None, adapter_dir: str | None
    ) -> str:
        sampler_id = f"{session_id}:sample:{seq}"
        if sampler_id in self.sessions:
            raise TinkerUserError(
                f"sampler {sampler_id} exists already (sampling_session_seq_id {seq!r} reused)"
            )
        self.sessions[sampler_id] = Sampler(sampler_id, session_id, base, model_path, adapter_dir)
        self.engine(base)
        return sampler_id

    def get(self, sampler_id: Any) -> Sampler:
        found = self.sessions.get(sampler_id) if isinstance(sampler_id, str) else None
        if found is None:
            raise TinkerNotFound(f"unknown sampling_session_id {sampler_id!r}")
        return found

    async def sample(self, sampler: Sampler, request: SampleRequest) -> bytes:
        from slime.engines.client import EngineClient

        proc = await self.engine(sampler.base_model)
        if "max_new_tokens" not in request.params:  # (max_tokens None: up to the model's context)
            left = self._context(sampler.base_model) - len(request.tokens)
            if left < 1:
                raise TinkerUserError(f"the prompt's {len(request.tokens)} tokens fill the model's context")
            request = dataclasses.replace(request, params={**request.params, "max_new_tokens": left})
        async with EngineClient(proc.url) as engine:
            adapter = None
            if sampler.checkpoint is not None:
                adapter = await self._load(engine, sampler.base_model, sampler.checkpoint)
            try:
                answers = await self._generate(engine, request, adapter)
            finally:
                if adapter is not None:
                    self._in_use[adapter] -= 1
        return sample_response(answers, len(request.tokens) if request.prompt_logprobs else None)

    @staticmethod
    async def _generate(engine: Any, request: SampleRequest, adapter: str | None) -> Any:
        """One /generate of num_samples copies of the prompt, sample i seeded seed + i."""
        params = []
        for i in range(request.num_samples):
            p = dict(request.params)
            if "seed" in p:
                p["seed"] = p["seed"] + i
            params.append(p)
        body: dict[str, Any] = {
            "input_ids": [request.tokens] * request.num_samples,
            "sampling_params": params,
            "return_logprob": True,
        }
        if request.prompt_logprobs:
            body["logprob_start_len"] = 0
        if adapter is not None:
            body["lora_path"] = adapter
        return await engine.request("POST", "/generate", body)

    def _context(self, base: str) -> int:
        return int(getattr(base_config(self.bases[base]).get_text_config(), "max_position_embeddings", 4096))

    async def _load(self, engine: Any, base: str, checkpoint: str) -> str:
        """The checkpoint's adapter in the engine of `base` (loaded once per version of its files:
        a checkpoint saved again under its name is loaded again), counted in use until the
        caller's sample ends; its name there. An engine keeps its `KEEP_LOADED` most recently
        used adapters: past that the least recently used one not in use is unloaded (it loads
        again from its directory when a sampler asks for it)."""
        adapter = os.path.join(checkpoint, "adapter")
        try:
            stamp = os.stat(os.path.join(adapter, "adapter_model.safetensors")).st_mtime_ns
        except OSError:
            raise TinkerNotFound(
                f"the weights of this sampler ({checkpoint}) are gone from the store: deleted, or (from "
                "save_weights_and_get_sampling_client) superseded by the model's newer ones, of which the "
                "last 8 are kept"
            ) from None
        key = (base, f"{adapter}@{stamp}")
        async with self._lock:
            name = self._loaded.pop(key, None)
            if name is None:
                name = f"ckpt-{next(self._names)}"
                await engine.request("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": adapter})
            self._loaded[key] = name  # the most recent now
            await self._unload_beyond(engine, base)
            self._in_use[name] += 1  # (last: a failed unload above leaves no count behind)
        return name

    async def _unload_beyond(self, engine: Any, base: str) -> None:
        mine = [k for k in self._loaded if k[0] == base]  # least recently used first
        for k in mine[: max(0, len(mine) - KEEP_LOADED)]:
            name = self._loaded[k]
            if self._in_use[name] == 0:
                try:
                    await engine.request("POST", "/unload_lora_adapter", {"lora_name": name})
                except Exception as e:  # kept loaded: the sample asked for goes on
                    logger.warning("unloading adapter %s from the %s engine failed: %s", name, base, e)
                    continue
                del self._loaded[k]
                self._in_use.pop(name, None)


def sample_response(answers: list[dict[str, Any]], prompt_length: int | None) -> bytes:
    pb = wire.pb()
    out = pb.SampleResponse()
    for answer in answers:
        meta = answer["meta_info"]
        sequence = out.sequences.add()
        reason = (meta.get("finish_reason") or {}).get("type")
        sequence.stop_reason = pb.STOP_REASON_LENGTH if reason == "length" else pb.STOP_REASON_STOP
        sequence.tokens = np.asarray(answer["output_ids"], dtype="<i4").tobytes()
        sequence.logprobs = np.asarray([e[0] for e in meta["output_token_logprobs"]], dtype="<f4").tobytes()
    if prompt_length is not None:
        values = [np.nan if e[0] is None else e[0] for e in answers[0]["meta_info"]["input_token_logprobs"]]
        out.prompt_logprobs = np.asarray(values[:prompt_length], dtype="<f4").tobytes()
    return out.SerializeToString()
