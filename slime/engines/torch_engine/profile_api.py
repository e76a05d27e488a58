"""SGLang's /start_profile and /stop_profile on the torch engine: a torch.profiler window over
engine steps (slime.utils.profiling), started and stopped on the engine thread.

    SGLANG_TORCH_PROFILER_DIR=/tmp/prof python -m slime.engines.torch_engine --model-path M ...
    curl -X POST $URL/start_profile -d '{"output_dir": "run1", "num_steps": 20}'
    # -> /tmp/prof/run1/<profile_id>-TP-0.trace.json.gz (SGLang's name) and <profile_id>-TP-0.txt,
    #    the operator table (slime's), after 20 engine steps or at /stop_profile

Files are written only under the directory SGLANG_TORCH_PROFILER_DIR names in the engine's
environment at start-up (SGLang's variable for its profiles' directory; without it the routes
answer 403 saying so): an `output_dir` is taken relative to it and must resolve inside it, as
/slime/dump_parameters keeps to --debug-dump-dir.

SGLang's body fields: output_dir (default: that directory), start_step (the
window opens at the first step numbered >= it; steps are counted from the engine's start, as
/server_info's num_steps), num_steps (the window closes itself after that many; none: at
/stop_profile), activities (CPU, GPU; SGLang's MEM, RPD, XPU and CUDA_PROFILER are refused),
with_stack (default true, as SGLang), record_shapes (default false), profile_prefix.
profile_by_stage and profile_stages (prefill and decode apart) are refused; merge_profiles is
accepted (one process: its one trace is the merge).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from slime.engines.protocol import PROFILE_DIR_ENV, ProtocolError
from slime.engines.torch_engine.http_util import json_object, read_json
from slime.utils.profiling import ProfileWindow, activities

logger = logging.getLogger(__name__)


@dataclass
class ProfileRequest:
    prefix: str
    """The files' path without their suffixes."""
    names: list[str] | None
    start_step: int | None
    num_steps: int | None
    with_stack: bool
    record_shapes: bool


class EngineProfiler:
    """The engine thread's side: `before_step` and `after_step` around every engine step."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.pending: ProfileRequest | None = None
        """Asked for and not finished (waiting for its start step, or running)."""
        self.window: ProfileWindow | None = None
        self.opened_at = 0
        """The engine's step count when the window opened."""

    def begin(self, request: ProfileRequest, step: int) -> None:
        """/start_profile, on the engine thread; `step`: the engine's steps so far."""
        if self.pending is not None:
            raise ProtocolError("Profiling is already in progress. Call /stop_profile first.")
        activities(self.device_type, request.names)  # an unknown or impossible set: 400 now
        self.pending = request
        if request.start_step is None or step >= request.start_step:
            try:
                self._open(step)
            except BaseException:
                self.pending = None
                raise

    def before_step(self, step: int) -> None:
        """A window whose start step has come opens (a failure to open is logged, the step runs)."""
        p = self.pending
        if p is not None and self.window is None and p.start_step is not None and step >= p.start_step:
            try:
                self._open(step)
            except Exception:
                logger.exception("the profile window could not open; the profile is dropped")
                self.pending = None

    def after_step(self, step: int) -> None:
        """`step`: the engine's step count now (a decode round of several steps counts them all).
        A full window closes; a failure to write it is logged, never the step's."""
        p = self.pending
        window_full = p is not None and p.num_steps is not None and step - self.opened_at >= p.num_steps
        if self.window is not None and window_full:
            try:
                self.end()
            except Exception:
                logger.exception("the profile window could not be written")

    def end(self) -> list[str]:
        """/stop_profile (or the last of num_steps): close the window, write its files."""
        p, window = self.pending, self.window
        if p is None:
            raise ProtocolError("Profiling is not in progress. Call /start_profile first.")
        self.pending, self.window = None, None
        if window is None:
            logger.info("profile stopped before its start step: nothing written")
            return []
        return window.stop(p.prefix, trace_suffix=".trace.json.gz")

    def _open(self, step: int) -> None:
        p = self.pending
        assert p is not None
        self.opened_at = step
        self.window = ProfileWindow.start(self.device_type, p.names, p.record_shapes, p.with_stack)


def _count(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ProtocolError(f"'{name}' must be a non-negative integer, got {value!r}")
    return value


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError(f"'{name}' must be true or false, got {value!r}")
    return value


def profile_request(body: dict[str, Any], root: str | None) -> ProfileRequest:
    """SGLang's ProfileReqInput, checked; ProtocolError names a refused field. `root`: the
    directory the files must go under (None: profiles are off, 403)."""
    if root is None:
        raise ProtocolError(
            f"profiles are off: this engine was started without {PROFILE_DIR_ENV}; start it with "
            f"{PROFILE_DIR_ENV}=DIR in its environment to allow /start_profile under DIR",
            403,
        )
    for name in ("profile_by_stage", "profile_stages"):
        if body.get(name):
            raise ProtocolError(
                f"'{name}': profiling prefill and decode apart is not built in the torch engine"
            )
    names = body.get("activities")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ProtocolError("'activities' must be a list of names (CPU, GPU)")
    out, prefix = body.get("output_dir") or "", body.get("profile_prefix") or ""
    if not isinstance(out, str) or not isinstance(prefix, str) or "\x00" in out + prefix or os.sep in prefix:
        raise ProtocolError(
            "'output_dir' and 'profile_prefix' must be strings ('profile_prefix' a file name)"
        )
    num_steps = _count(body, "num_steps")
    if num_steps == 0:
        raise ProtocolError("'num_steps' must be at least 1 (or absent: until /stop_profile)")
    target = os.path.realpath(os.path.join(root, out))
    if os.path.commonpath([root, target]) != root:
        raise ProtocolError(
            f"'output_dir' {out!r} resolves to {target!r}, outside the directory this engine may write "
            f"profiles into, {root!r} ({PROFILE_DIR_ENV}): refused",
            403,
        )
    name = f"{prefix}-" if prefix else ""
    return ProfileRequest(
        prefix=os.path.join(target, f"{name}{time.time()}-TP-0"),
        names=names,
        start_step=_count(body, "start_step"),
        num_steps=num_steps,
        with_stack=_flag(body, "with_stack", True),
        record_shapes=_flag(body, "record_shapes", False),
    )


class ProfileAPI:
    def __init__(self, engine: Any):
        self.engine = engine
        given = os.environ.get(PROFILE_DIR_ENV)
        # Resolved once, at start-up: a symlink swapped in for the directory later changes nothing.
        self.root = os.path.realpath(given) if given else None

    def register(self, router: web.UrlDispatcher) -> None:
        # POST only: SGLang takes GET too, but a GET that writes files or fails is no GET
        router.add_post("/start_profile", self.start_profile)
        router.add_post("/stop_profile", self.stop_profile)

    async def start_profile(self, request: web.Request) -> web.Response:
        body = json_object(await read_json(request, required=False))
        wanted = profile_request(body, self.root)
        engine = self.engine
        try:
            await engine.run(lambda: engine.profiler.begin(wanted, engine.num_steps))
        except ValueError as e:  # activities this run cannot profile
            raise ProtocolError(f"'activities': {e}") from None
        return web.Response(text="Start profiling.\n")

    async def stop_profile(self, request: web.Request) -> web.Response:
        engine = self.engine
        await engine.run(engine.profiler.end)
        return web.Response(text="Stop profiling. This will take some time.\n")
