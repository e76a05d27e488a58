"""What every route of the torch engine's HTTP server shares: the JSON error format, the body
reader, the API-key check.

A body the server cannot read is the client's mistake, so each way JSON can fail to decode
(syntax, encoding, nesting deeper than the parser's recursion limit, an integer beyond Python's
digit limit, the non-standard NaN / Infinity) is a 400, never a 500.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from aiohttp import web

from slime.engines.protocol import ProtocolError

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    409: "ConflictError",
    413: "RequestTooLargeError",
    503: "ServiceUnavailableError",
}


def error_response(message: str, status: int) -> web.Response:
    kind = _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return web.json_response(
        {"object": "error", "message": message, "type": kind, "code": status}, status=status
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


async def read_json(request: web.Request, required: bool = True) -> Any:
    """The decoded body; an empty body is `{}` unless `required`. ProtocolError (400) otherwise."""
    raw = await request.read()
    if not raw.strip():
        if required:
            raise ProtocolError("request body is empty; send a JSON object")
        return {}
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise ProtocolError("malformed JSON body: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the int digit limit, NaN
        raise ProtocolError(f"malformed JSON body: {e}") from None


def json_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    return body


def optional_str(body: dict[str, Any], name: str, default: str) -> str:
    """A string field that may be absent (or null / empty: `default`)."""
    value = body.get(name)
    if value is None or value == "":
        return default
    if not isinstance(value, str):
        raise ProtocolError(f"'{name}' must be a string, got {type(value).__name__}")
    return value


def is_open_path(path: str) -> bool:
    """Routes answered without the API key. As SGLang (sglang.srt.utils.auth): every path that
    starts with /health, so that routers and probes need no secret; they run no client code."""
    return path.startswith("/health")


def bearer_matches(authorization: str | None, api_key: str) -> bool:
    """`Authorization: Bearer <key>` (scheme in any case, as SGLang), compared in constant time.
    Bytes, because compare_digest refuses non-ASCII str and a hostile header may hold any."""
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(
        token.encode("utf-8", "surrogatepass"), api_key.encode("utf-8", "surrogatepass")
    )
