"""The server's door: the API key, the body size limit, and the error body for every error.

Checked before any route runs or any body is parsed, each refusal counted in the metrics
(macinfer.serve.metrics). The request bodies' own checks are macinfer.serve.schemas'.
An error's body is OpenAI's unless the route belongs to another protocol: `shapes` maps a route
prefix (`/v1/messages`, `/api/`) to that protocol's error body (macinfer.serve.anthropic, .ollama).
"""

from __future__ import annotations

import re
import secrets
from typing import Callable

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.responses import Response

from macinfer.errors import MacinferError
from macinfer.serve.metrics import ServerMetrics
from macinfer.serve.schemas import APIError

# A request body larger than this is refused (413): a long prompt is a few hundred KB of text, and
# parsing and tokenising a huge body would take memory and time from every other client.
MAX_BODY_BYTES = 8 << 20

ErrorShape = Callable[[APIError], Response]  # an APIError as a protocol's error response


def shaped(e: APIError, path: str, shapes: dict[str, ErrorShape]) -> Response:
    """`e` in the error shape of the protocol `path` belongs to (OpenAI's by default)."""
    for prefix, shape in shapes.items():
        if path.startswith(prefix):
            return shape(e)
    return e.response()


def check_api_key(api_key: str | None) -> None:
    """Refuse an empty key: it would reject every client while looking like no key at all.

    Raises:
        MacinferError: api_key is "" (or only spaces).
    """
    if api_key is not None and not api_key.strip():
        raise MacinferError("--api-key is empty: give a key, or leave the option out to serve without one")


class _RequestChecks:
    """ASGI middleware: the API key and the announced body size, checked before any route runs.

    NOTE: plain ASGI, not @app.middleware("http"): Starlette's BaseHTTPMiddleware hides the client's
    disconnect from the route (Request.is_disconnected stays False), so a non-streaming request
    ran to its end for a client that had gone.
    """

    def __init__(self, app, *, metrics: ServerMetrics, api_key: str | None, max_body_bytes: int, health_auth: bool,
                 shapes: dict[str, ErrorShape]):
        self.app, self.metrics, self.api_key = app, metrics, api_key
        self.max_body_bytes, self.health_auth, self.shapes = max_body_bytes, health_auth, shapes

    async def __call__(self, scope, receive, send):
        error = self._refusal(scope) if scope["type"] == "http" else None
        if error is None:
            return await self.app(scope, receive, send)
        self.metrics.errors.labels(str(error.status)).inc()
        await shaped(error, scope["path"], self.shapes)(scope, receive, send)

    def _refusal(self, scope) -> APIError | None:
        headers = Headers(scope=scope)
        open_route = scope["path"] == "/health" and not self.health_auth
        if self.api_key is not None and not open_route and not _authorized(headers, self.api_key):
            return APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' "
                                 "(or 'x-api-key: <key>')", None, "invalid_api_key",
                            headers={"WWW-Authenticate": 'Bearer realm="macinfer"'})
        size = headers.get("content-length", "")
        if size.isdigit() and int(size) > self.max_body_bytes:
            return _too_large(self.max_body_bytes)
        return None


def _too_large(max_body_bytes: int) -> APIError:
    return APIError(413, f"the request body is too large: this server takes at most {max_body_bytes:,} bytes",
                    None, "request_too_large")


# The tags pydantic adds to a location inside a union ("str", "list[dict[str,any]]", "function-after[...]").
_UNION_TAG = re.compile(r"^(str|int|float|bool|bytes|none|[\w-]+\[.*\]|function-[\w-]+|constrained-[\w-]+)$")


def openai_param(loc) -> str | None:
    """A validation error's location as OpenAI names a parameter: `messages[0].content`.

    pydantic's location also names the branch of a union that failed (`messages.0.content.str`):
    that is the validator's, not the client's, and is left out.
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _UNION_TAG.match(str(part)):
            break
        else:
            out += ("." if out else "") + str(part)
    return out or None


def _authorized(headers: Headers, api_key: str) -> bool:
    """`Authorization: Bearer <key>` (the scheme word in any case, RFC 7235), or Anthropic's `x-api-key: <key>`."""
    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode()):
        return True
    return secrets.compare_digest(headers.get("x-api-key", "").strip().encode(), api_key.encode())


def add_error_handling(app: FastAPI, metrics: ServerMetrics, api_key: str | None, max_body_bytes: int,
                        health_auth: bool, shapes: dict[str, ErrorShape] | None = None) -> None:
    """The API key and body size checks, and the error body for every error, each counted in the metrics.

    Args:
        shapes: {route prefix: the error body of the protocol served there}; other routes get OpenAI's.

    NOTE: a body announced larger than the limit by its Content-Length is refused by _RequestChecks,
    before anything is read; Starlette's RequestBodyLimitMiddleware (inside it) counts the bytes of
    the others (chunked bodies) as the route reads them and raises a 413 HTTPException (`http_error`).
    """
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=max_body_bytes)
    shapes = shapes or {}
    app.add_middleware(_RequestChecks, metrics=metrics, api_key=api_key, max_body_bytes=max_body_bytes,
                       health_auth=health_auth, shapes=shapes)  # added last: runs first

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        metrics.errors.labels(str(e.status)).inc()
        return shaped(e, request.url.path, shapes)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        loc = [x for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            why = (err.get("ctx") or {}).get("error")
            msg, param, code = "the request body is not valid JSON" + (f": {why}" if why else ""), None, "invalid_json"
        elif loc == [] and err.get("type") == "model_attributes_type":
            msg, param, code = "the request body must be a JSON object (Content-Type: application/json)", None, "invalid_json"
        else:
            param, code = openai_param(loc), err.get("type") or "invalid_value"
            msg = f"{param}: {err.get('msg', 'invalid value')}" if param else err.get("msg", "invalid request")
        return await api_error(request, APIError(400, msg, param, code))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        if e.status_code == 413:  # RequestBodyLimitMiddleware
            return await api_error(request, _too_large(max_body_bytes))
        if e.status_code == 400 and "parsing the body" in str(e.detail):  # FastAPI: not UTF-8, or nested too deeply
            return await api_error(request, APIError(400, "the request body is not valid JSON (it must be UTF-8 "
                                                          "and nested at most a few hundred levels)", None, "invalid_json"))
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_request")
        return await api_error(request, APIError(e.status_code, str(e.detail), None, code))
