"""The Tinker service's state and rules, apart from HTTP (slime.tinker.server): sessions and
their heartbeats, training clients' models, the order their requests run in, and the futures.

- A session lives while the SDK sends heartbeats (every 10 s); after `session_timeout_s` without
  one it expires: its requests are refused (410, naming the session) and its models released.
- A training model is `<session>:train:<model_seq_id>`, the id the SDK derives itself when it
  creates a client from a saved state.
- A model's requests run in their `seq_id` order (1, 2, 3, ...), whatever order they arrive in
  (the chunks of one forward_backward arrive concurrently). A request refused at submission
  still uses up its seq_id, so the ones after it do not wait for it. A seq_id that ran or is
  waiting already is refused as out of order.
- All the models' work runs on one thread, in the order the models' queues hand it over, the
  torch work never concurrent; with `--train-ranks N` each call runs on N FSDP ranks in that
  same order (slime.tinker.ranks).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from slime.tinker import losses, wire
from slime.tinker.errors import TinkerGone, TinkerNotFound, TinkerUserError
from slime.tinker.futures import Futures, Outcome
from slime.tinker.order import GAP_S, SeqQueue
from slime.tinker.ranks import RankGroup
from slime.tinker.sampler import SampleRequest, Samplers
from slime.tinker.store import Store
from slime.tinker.trainer import LoraSpec, RankedModel
from slime.utils.errors import UsageError

logger = logging.getLogger(__name__)

ADAM_DEFAULTS = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}
"""Tinker's AdamParams defaults."""


@dataclass
class Session:
    session_id: str
    heartbeat: float = field(default_factory=time.monotonic)
    ended: str | None = None
    """Why the session ended (then its requests are refused, naming it)."""


@dataclass
class ModelEntry:
    model_id: str
    session_id: str
    base_model: str
    spec: LoraSpec
    queue: SeqQueue
    model: RankedModel | None = None
    build: asyncio.Task[None] | None = None
    created: float = field(default_factory=time.time)


@dataclass(frozen=True)
class ServiceConfig:
    """What `python -m slime.tinker` was started with (slime.tinker.cli)."""

    bases: dict[str, str]
    """--model: the served base models' checkpoint directories, by name."""
    device: str = "cpu"
    lora_alpha: int = 32
    session_timeout_s: float = 600.0
    store: str = "tinker_store"
    check_precision: float | None = None
    """--check-precision's tolerance (None: off)."""
    train_ranks: int = 1
    """--train-ranks: the FSDP ranks every training model is sharded over."""


class Service:
    def __init__(self, cfg: ServiceConfig):
        self.cfg = cfg
        self.store = Store(cfg.store)
        self.samplers = Samplers(cfg.bases, cfg.device, self.store.logs)
        self.ranks = RankGroup(cfg.train_ranks)
        self._tasks: set[asyncio.Task[None]] = set()
        self.futures = Futures()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, ModelEntry] = {}
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="tinker-train")
        fd, rendezvous = tempfile.mkstemp(prefix="slime-tinker-pg-")
        os.close(fd)
        os.unlink(rendezvous)  # (a file:// rendezvous wants a path that does not exist yet)
        self.init_method = f"file://{rendezvous}"

    def close(self) -> None:
        """The worker ranks stop; the process group's rendezvous file goes (it exists once a
        model was built)."""
        self.ranks.close()
        path = self.init_method.removeprefix("file://")
        if os.path.exists(path):
            os.unlink(path)

    # ---- sessions ---------------------------------------------------------------------------
    def create_session(self, body: dict[str, Any]) -> dict[str, Any]:
        session_id = f"sess-{uuid.uuid4().hex[:12]}"
        self.sessions[session_id] = Session(session_id)
        return {"type": "create_session", "session_id": session_id}

    def session(self, session_id: Any) -> Session:
        s = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if s is None:
            raise TinkerNotFound(f"unknown session_id {session_id!r}")
        self._expire(s, time.monotonic())
        if s.ended is not None:
            raise TinkerGone(f"session {session_id} {s.ended}; create a new ServiceClient")
        return s

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        self.session(body.get("session_id")).heartbeat = time.monotonic()
        return {"type": "session_heartbeat"}

    def end_session(self, s: Session, why: str = "was finished (ServiceClient.close)") -> None:
        s.ended = why
        self.samplers.drop_session(s.session_id)
        for model_id in [m for m, e in self.models.items() if e.session_id == s.session_id]:
            self.executor.submit(self.store.prune_ephemeral, model_id, 0)  # (after its queued saves)
            model = self.models.pop(model_id).model
            if model is not None:  # (after the work queued before it; one still building closes itself)
                self.executor.submit(model.close)
        self.futures.drop_session(s.session_id)

    def expire(self) -> None:
        """End the sessions past their heartbeat timeout (their models' memory goes); drop the
        results fetched long enough ago (slime.tinker.futures); give up on seq_ids never sent."""
        self.futures.sweep()
        now = time.monotonic()
        for entry in self.models.values():
            skipped = entry.queue.skip_gap(now)
            if skipped:
                logger.warning(
                    "model %s: seq_ids %s never came in %g s; the requests after them run",
                    entry.model_id,
                    skipped,
                    GAP_S,
                )
        for s in list(self.sessions.values()):
            self._expire(s, now)

    def _expire(self, s: Session, now: float) -> None:
        """End `s` if its last heartbeat is older than the timeout."""
        if s.ended is None and now - s.heartbeat > self.cfg.session_timeout_s:
            self.end_session(s, f"expired: no heartbeat for {self.cfg.session_timeout_s:g} s")

    def _served(self, base: Any) -> str:
        """`base`, a served base model's name; refused by name otherwise."""
        if base not in self.cfg.bases:
            raise TinkerUserError(
                f"base_model {base!r} is not served here; served: {', '.join(self.cfg.bases)}"
            )
        return str(base)

    # ---- training models --------------------------------------------------------------------
    def create_model(self, body: dict[str, Any]) -> dict[str, Any]:
        s = self.session(body.get("session_id"))
        base = self._served(body.get("base_model"))
        if body.get("lora_config") is None:
            raise TinkerUserError(
                "create_model without lora_config (full fine-tuning) is not built on this server"
            )
        spec = LoraSpec.parse(body["lora_config"])
        return self._new_model(s, _seq(body.get("model_seq_id"), "model_seq_id"), base, spec, None)

    def _new_model(
        self,
        s: Session,
        model_seq_id: int,
        base: str,
        spec: LoraSpec,
        load: tuple[str, bool] | None,
        alpha: int | None = None,
    ) -> dict[str, Any]:
        """A training model built on the training thread (then, with `load`, a checkpoint's
        directory and whether its optimizer state, loaded into it); its future's id."""
        model_id = f"{s.session_id}:train:{model_seq_id}"
        if model_id in self.models:
            raise TinkerUserError(f"model {model_id} exists already (model_seq_id {model_seq_id!r} reused)")
        loop = asyncio.get_running_loop()
        entry = ModelEntry(model_id, s.session_id, base, spec, SeqQueue(loop.create_future()))
        self.models[model_id] = entry
        request_id = self.futures.create(s.session_id)
        entry.build = loop.create_task(self._build(entry, request_id, load, alpha or self.cfg.lora_alpha))
        return {"request_id": request_id, "model_id": model_id}

    async def _build(
        self, entry: ModelEntry, request_id: str, load: tuple[str, bool] | None, alpha: int
    ) -> None:
        path = self.cfg.bases[entry.base_model]

        def build() -> RankedModel:
            model = RankedModel(
                self.ranks,
                entry.model_id,
                entry.base_model,
                path,
                entry.spec,
                alpha,
                self.cfg.device,
                self.init_method,
                self.cfg.check_precision,
            )
            if load is not None:
                model.load(*load)
            return model

        try:
            entry.model = await asyncio.get_running_loop().run_in_executor(self.executor, build)
        except Exception as e:
            entry.queue.ready.set_exception(e)
            self.futures.resolve(request_id, _failure(e))
            return
        if entry.model_id not in self.models:  # its session ended meanwhile (end_session saw none)
            self.executor.submit(entry.model.close)
        entry.queue.ready.set_result(None)
        kind = "create_model" if load is None else "load_weights"
        self.futures.resolve(request_id, Outcome(json={"type": kind, "model_id": entry.model_id}))

    def model(self, model_id: Any) -> ModelEntry:
        entry = self.models.get(model_id) if isinstance(model_id, str) else None
        if entry is None:
            session_id = model_id.split(":")[0] if isinstance(model_id, str) else None
            if session_id in self.sessions:
                self.session(session_id)  # an expired or finished session says so
            raise TinkerNotFound(f"unknown model_id {model_id!r}")
        self.session(entry.session_id)
        return entry

    def get_info(self, body: dict[str, Any]) -> dict[str, Any]:
        entry = self.model(body.get("model_id"))
        return {
            "type": "get_info",
            "model_id": entry.model_id,
            "model_data": {"model_name": entry.base_model, "tokenizer_id": self.cfg.bases[entry.base_model]},
            "is_lora": True,
            "lora_rank": entry.spec.rank,
            "model_name": entry.base_model,
        }

    def submit(
        self, model_id: Any, seq_id: Any, check: Callable[[], None], work: Callable[[RankedModel], Outcome]
    ) -> dict[str, Any]:
        """Queue `work` as the model's request `seq_id` after `check` passed (a refused request
        still uses up its seq_id); its future's id."""
        entry = self.model(model_id)
        entry.queue.admit(seq_id)
        try:
            check()
        except BaseException:  # (any refusal: the seq_id is used up, the next ones do not wait)
            entry.queue.put(seq_id, None)
            raise
        request_id = self.futures.create(entry.session_id)

        async def job() -> None:
            try:
                await entry.queue.ready
                assert entry.model is not None
                outcome = await asyncio.get_running_loop().run_in_executor(self.executor, work, entry.model)
            except Exception as e:
                outcome = _failure(e)
            self.futures.resolve(request_id, outcome)

        entry.queue.put(seq_id, job)
        return {"request_id": request_id, "model_id": entry.model_id}

    def forward_backward(self, body: bytes) -> dict[str, Any]:
        message = wire.parse_forward_backward(body)
        request = wire.ForwardBackward(message.model_id, message.seq_id, [], "", {}, False)

        def check() -> None:
            nonlocal request
            request = wire.decode_forward_backward(message)
            if not request.data:
                raise TinkerUserError("forward_backward: no data (a list of Datum)")
            losses.check(request.loss_fn, [d.inputs for d in request.data], request.config)

        def work(model: RankedModel) -> Outcome:
            model.check(request.data)
            outputs, metrics = model.forward_backward(
                request.data, request.loss_fn, request.config, backward=not request.forward_only
            )
            return Outcome(proto=wire.forward_backward_output(outputs, metrics))

        return self.submit(message.model_id, message.seq_id, check, work)

    def optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        given = body.get("adam_params")
        adam = dict(ADAM_DEFAULTS)

        def check() -> None:
            if given is None:
                raise TinkerUserError(
                    "optim_step: only AdamParams (adam_params) is built here, not "
                    f"{(body.get('optimizer_params') or {}).get('type', 'another optimizer')!r}"
                )
            for key, value in given.items():
                if key in adam and isinstance(value, int | float):
                    adam[key] = float(value)
                elif key != "type":
                    raise TinkerUserError(f"adam_params[{key!r}] = {value!r}: not a number of AdamParams")

        def work(model: RankedModel) -> Outcome:
            return Outcome(json={"type": "optim_step", "metrics": model.optim_step(adam)})

        return self.submit(body.get("model_id"), body.get("seq_id"), check, work)

    # ---- checkpoints -------------------------------------------------------------------------
    def save_weights(self, body: dict[str, Any], sampler: bool = False) -> dict[str, Any]:
        """save_state (`weights`, with the optimizer state) or save_weights_for_sampler
        (`sampler_weights`, the adapters alone) under the name given; unnamed
        (save_weights_and_get_sampling_client): a sampling session on the weights saved under a
        name of the session's sampler count."""
        entry = self.model(body.get("model_id"))
        kind = "sampler_weights" if sampler else "weights"
        unnamed = sampler and body.get("path") is None
        overwrite = bool(body.get("overwrite", False)) or unnamed
        target, sampler_id = None, None

        def check() -> None:
            nonlocal target, sampler_id
            seq = _seq(body.get("sampling_session_seq_id"), "sampling_session_seq_id") if unnamed else None
            if unnamed:
                assert seq is not None
                target = self.store.ephemeral(entry.model_id, seq)
            else:
                target = self.store.checkpoint(entry.model_id, kind, body.get("path"))
            if unnamed:  # (its engine loads the adapter at the first sample, after the save)
                # (no model_path: these weights have no tinker:// path, slime.tinker.store)
                sampler_id = self.samplers.create(
                    entry.session_id, seq, entry.base_model, None, target.directory
                )

        def work(model: RankedModel) -> Outcome:
            assert target is not None
            with self.store.written(target, overwrite, {**model.meta(), "kind": kind}) as directory:
                model.save(directory, optimizer=not sampler)
            if sampler_id is not None:
                self.store.prune_ephemeral(entry.model_id)
                return Outcome(json={"type": "save_weights_for_sampler", "sampling_session_id": sampler_id})
            answer = "save_weights_for_sampler" if sampler else "save_weights"
            return Outcome(json={"type": answer, "path": target.uri})

        return self.submit(entry.model_id, body.get("seq_id"), check, work)

    def load_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        """load_state on a model (in its seq_id order), or a new model from a saved state
        (create_training_client_from_state: a session and a model_seq_id, no model_id)."""
        optimizer = bool(body.get("optimizer", False))
        if "model_id" not in body:
            s = self.session(body.get("session_id"))
            found = self.store.find(body.get("path"))
            meta = found.meta()
            base = body.get("base_model") or meta["base_model"]
            if base not in self.cfg.bases:
                raise TinkerUserError(
                    f"{found.uri} was trained on {base!r}, which this server does not serve"
                )
            spec = LoraSpec.parse(meta["lora_config"])
            if optimizer and not os.path.isdir(os.path.join(found.directory, "state")):
                raise TinkerUserError(
                    f"{found.uri} holds no optimizer state (saved for a sampler, or without it)"
                )
            seq = _seq(body.get("model_seq_id"), "model_seq_id")
            return self._new_model(s, seq, base, spec, (found.directory, optimizer), meta.get("lora_alpha"))
        entry = self.model(body.get("model_id"))

        def check() -> None:
            meta = self.store.find(body.get("path")).meta()
            alpha = entry.model.alpha if entry.model is not None else meta.get("lora_alpha")
            same = meta["base_model"] == entry.base_model and meta.get("lora_alpha") == alpha
            if not same or LoraSpec.parse(meta["lora_config"]) != entry.spec:
                raise TinkerUserError(
                    f"{body.get('path')} holds adapters of {meta['base_model']} with {meta['lora_config']}; "
                    f"this model is {entry.base_model} with {asdict(entry.spec)}"
                )

        def work(model: RankedModel) -> Outcome:
            model.load(self.store.find(body.get("path")).directory, optimizer)
            return Outcome(json={"type": "load_weights", "path": body.get("path")})

        return self.submit(entry.model_id, body.get("seq_id"), check, work)

    # ---- sampling ----------------------------------------------------------------------------
    def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        """A sampler of a saved checkpoint (`model_path`) or of a base model."""
        s = self.session(body.get("session_id"))
        seq = _seq(body.get("sampling_session_seq_id"), "sampling_session_seq_id")
        if body.get("model_path") is not None:
            found = self.store.find(body["model_path"])
            base = found.meta()["base_model"]
            if base not in self.cfg.bases:
                raise TinkerUserError(
                    f"{found.uri} was trained on {base!r}, which this server does not serve"
                )
            sampler_id = self.samplers.create(s.session_id, seq, base, found.uri, found.directory)
        else:
            base = self._served(body.get("base_model"))
            sampler_id = self.samplers.create(s.session_id, seq, base, None, None)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        found = self.samplers.get(sampler_id)
        return {
            "sampler_id": found.sampler_id,
            "base_model": found.base_model,
            "model_path": found.model_path,
        }

    def asample(self, body: dict[str, Any]) -> dict[str, Any]:
        sampler = self.samplers.get(body.get("sampling_session_id"))
        self.session(sampler.session_id)
        request = SampleRequest.parse(body)
        request_id = self.futures.create(sampler.session_id)

        async def run() -> None:
            try:
                outcome = Outcome(proto=await self.samplers.sample(sampler, request))
            except Exception as e:
                outcome = _failure(e)
            self.futures.resolve(request_id, outcome)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        ids = [f"{request_id}:{i}" for i in range(request.num_samples)]
        return {"request_id": request_id, "sample_sequence_ids": ids}


def _seq(value: Any, field: str) -> int:
    """A client's counter (model_seq_id, sampling_session_seq_id): it names models, samplers and
    checkpoint directories, so it must be what the SDK sends, an int >= 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TinkerUserError(f"{field} must be an int >= 0, got {value!r}")
    return value


def _failure(e: BaseException) -> Outcome:
    if isinstance(e, TinkerUserError | UsageError):
        return Outcome(error=str(e), category="user")
    return Outcome(error=f"{type(e).__name__}: {e}", category="server")
