"""Weight-debugging routes of the torch engine: SGLang's /weights_checker and slime's /slime/*
extensions (checksums, fingerprints, parameter dumps).

/slime/dump_parameters writes files (as /start_profile, which keeps to its own directory:
slime.engines.torch_engine.profile_api), so it writes only under the directory
the engine was started with (`--debug-dump-dir`). A requested path (relative paths are taken
under that directory) must still lie under it once `..` and symlinks are resolved, else 403;
without the flag the route answers 403 saying how to enable it. The directories are then
created and opened one component at a time without following symlinks, and every file is opened
with O_NOFOLLOW, so a symlink planted inside the directory after the check cannot redirect a
write either: nothing is created outside it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from typing import Any

from aiohttp import web

from slime.engines.protocol import ProtocolError
from slime.engines.torch_engine.engine import TorchEngine
from slime.engines.torch_engine.http_util import json_object, read_json

logger = logging.getLogger(__name__)

# Failures of the machine, not of the request.
_SERVER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENOMEM}
_PATH_MAX = 4096  # Linux's; walking by directory fds would allow deeper trees than anything can name
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class WeightsDebugAPI:
    """The handlers; `dump_dir` is `--debug-dump-dir` (None: dumps are refused)."""

    def __init__(self, engine: TorchEngine, dump_dir: str | None):
        self.engine = engine
        # Resolved once, at start-up: a symlink swapped in for the directory later changes nothing.
        self.dump_root = os.path.realpath(dump_dir) if dump_dir else None

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_route("*", "/slime/weights_checksum", self.weights_checksum)
        router.add_post("/weights_checker", self.weights_checker)
        router.add_route("*", "/slime/weights_fingerprint", self.weights_fingerprint)
        router.add_post("/slime/dump_parameters", self.dump_parameters)

    async def weights_checksum(self, request: web.Request) -> web.Response:
        """slime extension: {"names": [...]?} -> {"weight_version", "checksums": {name: sha256}}."""
        body = {} if request.method == "GET" else json_object(await read_json(request, required=False))
        names = body.get("names")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise ProtocolError("'names' must be a list of parameter names")
        result = await self.engine.run(lambda: self.engine.weights.checksums(names))
        return web.json_response({"weight_version": self.engine.weight_version, "checksums": result})

    async def weights_checker(self, request: web.Request) -> web.Response:
        """SGLang's /weights_checker: {"action": "snapshot" | "reset_tensors" | "compare"} ->
        {"success", "message"}, HTTP 400 when the action fails (compare: the differing tensors); a
        passing compare adds "note" (slime's: how parameters that arrived narrower were compared)."""
        body = json_object(await read_json(request))
        action = body.get("action")
        store = self.engine.weights
        actions = {"snapshot": store.snapshot, "reset_tensors": store.reset_tensors, "compare": store.compare}
        if not isinstance(action, str) or action not in actions:
            raise ProtocolError(f"'action' must be one of {', '.join(actions)}, got {_short(action)}")
        try:
            result = await self.engine.run(actions[action])
        except ProtocolError as e:
            return web.json_response({"success": False, "message": e.message}, status=400)
        if action == "compare":
            problems, note = result
            if problems:
                message = "check tensor equality failed:\n" + "\n".join(problems)
                return web.json_response({"success": False, "message": message}, status=400)
            what = "parameters equal the snapshot" + (f" ({note})" if note else "")
            return web.json_response({"success": True, "message": f"{action}: {what}", "note": note})
        return web.json_response({"success": True, "message": f"{action}: {result} parameters"})

    async def weights_fingerprint(self, request: web.Request) -> web.Response:
        """slime extension: {"weight_version", "fingerprints": {name: {dtype, shape, fingerprint}}}
        for every parameter (slime.utils.checksum.tensor_fingerprint)."""
        result = await self.engine.run(self.engine.weights.fingerprints)
        return web.json_response({"weight_version": self.engine.weight_version, "fingerprints": result})

    async def dump_parameters(self, request: web.Request) -> web.Response:
        """slime extension: {"path": DIR} -> every parameter torch.save'd to DIR/<HF name>, DIR
        under --debug-dump-dir (absolute, or relative to it); with --enable-lora also each loaded
        adapter's tensors (slime.utils.peft_files.dump_name)."""
        body = json_object(await read_json(request))
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise ProtocolError("'path' must be a directory path (a non-empty string)")
        target = self.dump_target(path)

        def _dump() -> int:
            dir_fd = self._open_dump_dir(target)
            try:
                adapters = self.engine.adapters
                return self.engine.weights.dump(
                    dir_fd, adapters.dump_tensors() if adapters is not None else ()
                )
            except OSError as e:
                raise _os_error(f"cannot write the parameter dump into {target!r}", e) from None
            finally:
                os.close(dir_fd)

        count = await self.engine.run(_dump)
        return web.json_response({"success": True, "num_parameters": count, "path": target})

    def dump_target(self, path: str) -> str:
        """The resolved directory `path` names; ProtocolError 403 unless it is under the dump root."""
        root = self.dump_root
        if root is None:
            raise ProtocolError(
                "parameter dumps are off: this engine was started without --debug-dump-dir; "
                "start it with --debug-dump-dir DIR to allow /slime/dump_parameters under DIR",
                403,
            )
        if "\x00" in path:
            raise ProtocolError("'path' holds a NUL character")
        target = os.path.realpath(os.path.join(root, path))
        if len(target.encode()) >= _PATH_MAX:
            raise ProtocolError(
                f"'path' resolves to {len(target.encode())} bytes, over the limit of {_PATH_MAX}"
            )
        if os.path.commonpath([root, target]) != root:
            raise ProtocolError(
                f"'path' {_short(path)} resolves to {_short(target)}, which is outside the directory "
                f"this engine may dump into, {root!r} (--debug-dump-dir): refused",
                403,
            )
        return target

    def _open_dump_dir(self, target: str) -> int:
        """Create `target` (under the root) one component at a time and return an fd of it;
        no component may be a symlink, whatever was checked before."""
        assert self.dump_root is not None
        try:
            os.makedirs(self.dump_root, exist_ok=True)
            fd = os.open(self.dump_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise _os_error(f"cannot open the dump directory {self.dump_root!r}", e) from None
        relative = os.path.relpath(target, self.dump_root)
        parts = [] if relative == "." else relative.split(os.sep)
        try:
            for part in parts:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ProtocolError(
                    f"cannot dump into {_short(target)}: a component is a symlink or not a directory "
                    "(symlinks are not followed inside the dump directory)",
                    403,
                ) from None
            raise _os_error(f"cannot create the dump directory {_short(target)}", e) from None
        return fd


def _os_error(what: str, e: OSError) -> ProtocolError:
    return ProtocolError(f"{what}: {e.strerror or e}", 500 if e.errno in _SERVER_ERRNOS else 400)


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
