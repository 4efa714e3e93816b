"""`macinfer serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine loop.

Routes: POST /v1/chat/completions and /v1/completions (server-sent events when
`stream` is true), GET /v1/models, /health and /metrics (Prometheus text).

Design choices:
- Every request goes through one AsyncEngine, so concurrent clients share the
  engine's batched steps; a client that disconnects aborts its request.
- Input is checked before anything is queued (schema, parameters, prompt length),
  so every bad request gets a 4xx with OpenAI's error body and the first streamed
  byte is only sent once the engine has accepted the request.
- Extensions beyond OpenAI's schema, as vLLM names them: top_k, min_p, ignore_eos,
  return_token_ids (each choice, or streamed chunk, then carries `token_ids`).

The request bodies, their checks and the error body are in macinfer.serve.schemas.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import threading
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from macinfer.serve.async_engine import AsyncEngine, EngineDeadError
from macinfer.errors import MacinferError
from macinfer.core.sampling import SamplingParams
from macinfer.serve.metrics import ServerMetrics
from macinfer.serve.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    RequestBase,
    check_supported,
    message_text,
)

log = logging.getLogger("macinfer.serve.server")


# -- the app ------------------------------------------------------------------------------
class Server:
    """Turns validated OpenAI requests into engine requests and responses."""

    def __init__(self, llm, engine: AsyncEngine, model_name: str, metrics: ServerMetrics):
        self.llm, self.engine, self.model_name, self.metrics = llm, engine, model_name, metrics
        self.created = int(time.time())

    # -- request -> (prompt ids, params) ------------------------------------------------
    def _check_model(self, req: RequestBase) -> None:
        if req.model is not None and req.model not in (self.model_name, str(self.llm.info.path)):
            raise APIError(404, f"the model '{req.model}' does not exist: this server serves '{self.model_name}'",
                           "model", "model_not_found")

    def _params(self, req: RequestBase, num_prompt: int, max_tokens: int | None) -> SamplingParams:
        ctx = self.llm.info.context_length
        if num_prompt >= ctx:
            raise APIError(400, f"the prompt is {num_prompt} tokens but {self.model_name} holds at most {ctx}: "
                                "shorten it", "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                           "context_length_exceeded")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        try:
            return SamplingParams(
                temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                seed=req.seed, stop=stop, ignore_eos=req.ignore_eos,
                # None: as much as the context allows. Beyond the context, the engine stops with "length".
                max_tokens=ctx - num_prompt if max_tokens is None else max_tokens,
            )
        except ValueError as e:
            msg = str(e)
            raise APIError(400, msg, msg.split(" ", 1)[0], "invalid_value") from None

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not req.messages:
            raise APIError(400, "messages must hold at least one message", "messages")
        messages = []
        for i, m in enumerate(req.messages):
            role = "system" if m.role == "developer" else m.role
            messages.append({"role": role, "content": message_text(m, i)})
        try:
            return self.llm.apply_chat_template(messages)
        except MacinferError as e:
            raise APIError(400, str(e), "messages") from None
        except Exception as e:  # jinja's TemplateError, raise_exception() in templates
            raise APIError(400, f"the chat template rejected these messages: {e}", "messages") from None

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "send one prompt per request (got a batch of prompts)", "prompt")
            p = p[0]
        if isinstance(p, list) and any(not (0 <= t < (self.llm.info.config.get("vocab_size") or 2**31)) for t in p):
            raise APIError(400, "prompt token ids must be in the model's vocabulary", "prompt")
        try:
            return self.llm.encode(p)
        except MacinferError as e:
            raise APIError(400, str(e), "prompt") from None

    # -- responses -----------------------------------------------------------------------
    def _usage(self, out) -> dict:
        m = out.metrics
        return {
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(out.token_ids),
            "total_tokens": len(out.prompt_token_ids) + len(out.token_ids),
            "prompt_tokens_details": {"cached_tokens": m.cached_tokens},
        }

    async def handle(self, req: RequestBase, http: Request, chat: bool) -> Any:
        self._check_model(req)
        check_supported(req)
        ids = self.chat_prompt(req) if chat else self.completion_prompt(req)
        max_tokens = req.max_completion_tokens if chat and req.max_completion_tokens is not None else req.max_tokens
        params = self._params(req, len(ids), max_tokens)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        deltas = self.engine.generate(ids, params, request_id=rid)
        try:
            # Wait for the engine to accept it (and for the first token) before committing to a 200.
            first = await _next_or_disconnect(deltas, http)
        except EngineDeadError as e:
            raise APIError(503, str(e), None, "engine_unavailable", "server_error") from None
        except (MacinferError, ValueError) as e:
            raise APIError(400, str(e), None, "invalid_request") from None
        if first is None:  # the client left during the prefill
            return PlainTextResponse("", status_code=499)
        kind = "chat.completion" if chat else "text_completion"
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._sse(first, deltas, rid, kind, chat, include_usage, req.return_token_ids)
            return StreamingResponse(body, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, d = [first.text], first
        while d.finish_reason is None:
            d = await _next_or_disconnect(deltas, http)
            if d is None:
                return PlainTextResponse("", status_code=499)
            text.append(d.text)
        out = d.output
        self.metrics.observe_request(out, "chat" if chat else "completions")
        choice = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        if req.return_token_ids:
            choice["token_ids"] = list(out.token_ids)
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name,
                "choices": [choice], "usage": self._usage(out)}

    async def _sse(self, first, deltas, rid, kind, chat, include_usage, token_ids) -> AsyncIterator[str]:
        created = int(time.time())
        obj = kind + ".chunk" if chat else kind

        def chunk(text: str | None, finish: str | None, role: bool = False, ids: list[int] | None = None) -> str:
            if chat:
                delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            if token_ids and ids is not None:
                choice["token_ids"] = ids
            c = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}
            if include_usage:
                c["usage"] = None
            return f"data: {json.dumps(c)}\n\n"

        try:
            if chat:
                yield chunk("", None, role=True)
            d = first
            while True:
                if d.finish_reason is not None:
                    break
                if d.text or (token_ids and d.token_ids):
                    yield chunk(d.text, None, ids=d.token_ids)
                d = await deltas.__anext__()
            out = d.output
            # The last delta may still carry text (a flushed tail) along with the finish reason.
            yield chunk(d.text or (None if chat else ""), out.finish_reason, ids=d.token_ids)
            if include_usage:
                usage = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                         "choices": [], "usage": self._usage(out)}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
            self.metrics.observe_request(out, "chat" if chat else "completions")
        finally:
            await deltas.aclose()  # aborts the request if it is still running (client left)


async def _next_or_disconnect(deltas, http: Request, poll: float = 0.5):
    """The next delta, or None if the client disconnects first (the request is then aborted)."""
    task = asyncio.ensure_future(deltas.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if await http.is_disconnected():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                await deltas.aclose()
                return None
    except asyncio.CancelledError:
        task.cancel()
        await deltas.aclose()
        raise


# A request body larger than this is refused before it is read (413): a long prompt is a few
# hundred KB of text, and parsing and tokenising a huge body would stall every other client.
MAX_BODY_BYTES = 8 << 20


def create_app(llm, *, api_key: str | None = None, model_name: str | None = None, engine=None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """Build the FastAPI app serving `llm` (a macinfer.LLM).

    Args:
        api_key: if set, every request must send `Authorization: Bearer <api_key>`.
        model_name: the name clients pass as `model` (default: the model's name).
        engine: the engine to drive; default: the LLM's continuous-batching engine.
        max_body_bytes: larger request bodies (by their Content-Length) get a 413.
    """
    model_name = model_name or llm.info.name
    metrics = ServerMetrics()
    ranks = getattr(llm, "ranks", None)  # across ranks: the idle engine thread keeps the others posted
    aengine = AsyncEngine(engine or llm.engine, on_step=metrics.observe_step,
                          on_idle=ranks.heartbeat if ranks is not None else None)
    metrics.attach(aengine)
    server = Server(llm, aengine, model_name, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        aengine.start()
        yield
        aengine.shutdown()

    app = FastAPI(title="macinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    _add_error_handling(app, metrics, api_key, max_body_bytes)
    _add_routes(app, server)
    return app


def _add_error_handling(app: FastAPI, metrics: ServerMetrics, api_key: str | None, max_body_bytes: int) -> None:
    """The API key and body size checks, and OpenAI's error body for every error, each counted in the metrics."""

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        size = request.headers.get("content-length", "")
        if size.isdigit() and int(size) > max_body_bytes:
            metrics.errors.labels("413").inc()
            return APIError(413, f"the request body is {int(size):,} bytes; this server takes at most "
                                 f"{max_body_bytes:,}", None, "request_too_large").response()
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                metrics.errors.labels("401").inc()
                return APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                None, "invalid_api_key").response()
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        metrics.errors.labels(str(e.status)).inc()
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            why = (err.get("ctx") or {}).get("error")
            msg, param = "the request body is not valid JSON" + (f": {why}" if why else ""), None
        elif loc == [] and err.get("type") == "model_attributes_type":
            msg, param = "the request body must be a JSON object (Content-Type: application/json)", None
        else:
            param = ".".join(loc) or None
            msg = f"{param}: {err.get('msg', 'invalid value')}" if param else err.get("msg", "invalid request")
        return await api_error(request, APIError(400, msg, param, err.get("type")))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return await api_error(request, APIError(e.status_code, str(e.detail), None, None))


def _add_routes(app: FastAPI, server: Server) -> None:
    """The OpenAI routes, /health and /metrics."""

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.handle(body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.handle(body, request, chat=False)

    @app.get("/v1/models")
    async def models():
        card = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "macinfer",
                "max_model_len": server.llm.info.context_length}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if not server.engine.is_running:
            return JSONResponse({"status": "error", "error": str(server.engine.error)}, status_code=503)
        return {"status": "ok", "model": server.model_name, "running_requests": server.engine.num_active}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = server.metrics.render()
        return PlainTextResponse(body, media_type=content_type)


def run(llm, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, log_level: str = "info") -> None:
    """Serve until interrupted."""
    import uvicorn

    uvicorn.run(create_app(llm, api_key=api_key), host=host, port=port, log_level=log_level)


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
    """Run `app` with uvicorn on a background thread; yields its base URL (tests, bench).

    port 0 picks a free port.
    """
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise MacinferError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
