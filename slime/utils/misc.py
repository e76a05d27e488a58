"""Helpers slime's plugins import from `slime.utils.misc`."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from slime.utils.errors import UsageError

__all__ = ["SingletonMeta", "load_function"]


def load_function(path: str, flag: str = "load_function") -> Callable[..., Any]:
    """The object at `package.module.name` (slime's signature); the framework passes the flag
    that named it (`--custom-rm-path`, ...), so that the one clear error names that flag."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise UsageError(f"{flag} {path!r} must be a dotted path: package.module.function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"{flag} {path!r}: cannot import module {module_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UsageError(f"{flag} {path!r}: module {module_name!r} has no function {attr!r}")
    return fn


class SingletonMeta(type):
    """A metaclass whose classes have one instance per process: the first call builds it, later
    calls return it (their arguments unused). `Cls.clear_instances()` forgets Cls's instance."""

    _instances: ClassVar[dict[type, Any]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        with SingletonMeta._lock:
            if cls not in SingletonMeta._instances:
                SingletonMeta._instances[cls] = super().__call__(*args, **kwargs)
            return SingletonMeta._instances[cls]

    def clear_instances(cls) -> None:
        with SingletonMeta._lock:
            SingletonMeta._instances.pop(cls, None)
