"""`macinfer serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine loop.

Routes: POST /v1/chat/completions and /v1/completions (server-sent events when
`stream` is true), GET /v1/models, /health and /metrics (Prometheus text). The other protocols'
routes (OpenAI Responses, Anthropic Messages, Ollama) are their adapters' (macinfer.serve.responses,
.anthropic, .ollama, .ollama_models), each over the same request path (macinfer.serve.generation).

Design choices:
- Every request goes through its model's AsyncEngine, so concurrent clients of a model share
  the engine's batched steps; a client that disconnects aborts its request. Which models are
  loaded (the default, others on demand, under a budget) is macinfer.serve.model_pool's.
- Input is checked before anything is queued (schema, parameters, prompt length),
  so every bad request gets a 4xx with OpenAI's error body and the first streamed
  byte is only sent once the engine has accepted the request.
- Extensions beyond OpenAI's schema, as vLLM names them: top_k, min_p, ignore_eos,
  return_token_ids (each choice, or streamed chunk, then carries `token_ids`),
  guided_json / guided_regex / guided_choice / guided_grammar.
- Structured output (`response_format` json_object / json_schema, the guided_* fields) is
  enforced while sampling, by a grammar mask on each token (macinfer.core.grammar).
- A chat request goes through macinfer.chat (the template, thinking, tool calls and their
  grammars: `prepare`); each choice renders its reply's events (macinfer.serve.choices):
  `reasoning_content` / `reasoning` apart from `content`, tool calls streamed as OpenAI streams
  them, `usage.completion_tokens_details.reasoning_tokens`.

The request bodies, their checks and the error body are in macinfer.serve.schemas; the API key, the
body size limit and the error handlers in macinfer.serve.guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import threading
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from macinfer.chat.request import ChatRequest, ChatRequestError, PreparedChat, prepare
from macinfer.serve import anthropic, ollama, ollama_models, responses
from macinfer.serve.async_engine import AsyncEngine, EngineDeadError
from macinfer.serve.choices import Choice
from macinfer.serve.generation import check_queue, close_streams, engine_stopped, next_or_disconnect
from macinfer.serve.guard import MAX_BODY_BYTES, add_error_handling, check_api_key
from macinfer.serve.images import has_images, image_messages, request_messages
from macinfer.errors import InvalidGrammar, MacinferError
from macinfer.core.sampling import SamplingParams
from macinfer.core.sampling_params import MAX_TOP_LOGPROBS
from macinfer.serve.metrics import ServerMetrics
from macinfer.serve.model_pool import ModelPool, PoolOptions, ServedModel
from macinfer.serve.response_store import ResponseStore
from macinfer.serve.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    RequestBase,
    check_known,
    check_supported,
    message_text,
    structured_output,
)

log = logging.getLogger("macinfer.serve.server")


# -- the app ------------------------------------------------------------------------------
class Server:
    """Turns validated OpenAI requests into engine requests and responses, each on its model's engine."""

    def __init__(self, pool: ModelPool, metrics: ServerMetrics, max_queue: int, lenient: bool = False,
                 allow_remote_images: bool = False):
        self.pool, self.metrics = pool, metrics
        self.lenient = lenient  # accept and ignore unknown request fields
        self.allow_remote_images = allow_remote_images  # image parts may name http(s) URLs (macinfer.serve.images)
        self.created = int(time.time())
        self.max_queue = max_queue

    @property
    def engine(self) -> AsyncEngine:
        """The default model's engine loop."""
        return self.pool.default.engine

    @property
    def model_name(self) -> str:
        return self.pool.default.name

    # -- request -> (prompt ids, params) ------------------------------------------------
    @staticmethod
    def _params(m: ServedModel, req: RequestBase, num_prompt: int, max_tokens: int | None, chat: bool,
                structured=None) -> SamplingParams:
        ctx = m.llm.info.context_length
        if num_prompt >= ctx:
            raise APIError(400, f"the prompt is {num_prompt} tokens but {m.name} holds at most {ctx}: "
                                "shorten it", "messages" if chat else "prompt", "context_length_exceeded")
        try:
            return SamplingParams(
                temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                seed=req.seed, stop=req.stop, ignore_eos=req.ignore_eos,
                structured=structured if chat else structured_output(req),
                # None: as much as the context allows. Beyond the context, the engine stops with "length".
                max_tokens=ctx - num_prompt if max_tokens is None else max_tokens,
                logprobs=_logprobs(req, chat), presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                repetition_context_size=req.repetition_context_size, logit_bias=_logit_bias(req.logit_bias),
            )
        except ValueError as e:
            msg = str(e)
            raise APIError(400, msg, msg.split(" ", 1)[0], "invalid_value") from None

    @staticmethod
    def chat_prepare(llm, req: ChatCompletionRequest, allow_remote_images: bool = False) -> PreparedChat:
        """The chat request through macinfer.chat: prompt ids (and images), its grammar, a parser per choice.

        Raises:
            APIError: 400 naming the field that cannot be honoured.
        """
        if has_images(raw := request_messages(req)):  # image parts: read, checked, {"type": "image"} for the template
            messages, pictures = image_messages(llm, raw, allow_remote_images)
        else:
            messages, pictures = [], None
            for i, m in enumerate(req.messages):
                role = "system" if m.role == "developer" else m.role
                # Extra fields (tool_calls, tool_call_id, name, reasoning_content) go to the template as they came.
                messages.append({**(m.model_extra or {}), "role": role, "content": message_text(m, i)})
        rf = req.response_format.model_dump(by_alias=True, exclude_none=True) if req.response_format else None
        creq = ChatRequest(messages, tools=req.tools, tool_choice=req.tool_choice,
                           parallel_tool_calls=req.parallel_tool_calls, response_format=rf,
                           reasoning_effort=req.reasoning_effort, template_kwargs=req.chat_template_kwargs)
        try:
            return prepare(llm.tokenizer, creq, SamplingParams(structured=structured_output(req, response_format=False)),
                           images=pictures, vision=llm.images)
        except ChatRequestError as e:
            raise APIError(400, str(e), e.param, "invalid_value") from None
        except MacinferError as e:  # the model's own format cannot be read here: not the request's fault
            raise APIError(500, str(e), None, "model_format_unavailable", "server_error") from None

    @staticmethod
    def completion_prompt(llm, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "send one prompt per request (got a batch of prompts)", "prompt")
            p = p[0]
        if isinstance(p, list) and any(not (0 <= t < (llm.info.config.get("vocab_size") or 2**31)) for t in p):
            raise APIError(400, "prompt token ids must be in the model's vocabulary", "prompt")
        try:
            return llm.encode(p)
        except MacinferError as e:
            raise APIError(400, str(e), "prompt") from None

    # -- responses -----------------------------------------------------------------------
    @staticmethod
    def _usage(choices: list[Choice]) -> dict:
        """Usage of a response: the prompt once, the completion (and thought) tokens of every choice."""
        outs = [c.output for c in choices]
        prompt, completion = len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": outs[0].metrics.cached_tokens}}
        if choices[0].chat:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(c.reasoning_tokens for c in choices)}
        return usage

    @staticmethod
    def _start(engine: AsyncEngine, ids: list[int], params: SamplingParams, rid: str, n: int, mm=None) -> list:
        """The engine requests of a response: one per choice, choice i seeded seed + i (as vLLM
        seeds n > 1), the others forks of the first (they share its prompt's KV blocks); `mm`: the
        prompt's images, or None."""
        streams = []
        for i in range(n):
            p = params if i == 0 else dataclasses.replace(params, seed=None if params.seed is None else
                                                          (params.seed + i) % 2**64)
            streams.append(engine.generate(ids, p, request_id=rid if i == 0 else f"{rid}-{i}",
                                                fork_of=rid if i else None, mm=mm))
        return streams

    async def handle(self, req: RequestBase, http: Request, chat: bool) -> Any:
        """The response to one request, on the model it names (loaded first if need be).

        NOTE: the model is held until the response is built; a streamed response keeps it busy
        through its engine streams (ModelPool never unloads a model with a stream open).
        """
        await self.pool.lookup(req.model)  # 404 before anything else, and before any load
        check_known(req, self.lenient)
        check_supported(req)
        m = await self.pool.acquire(req.model)
        try:
            return await self._respond(m, req, http, chat)
        finally:
            self.pool.release(m)

    async def _respond(self, m: ServedModel, req: RequestBase, http: Request, chat: bool) -> Any:
        llm = m.llm
        # NOTE: tokenising (and the chat template, and compiling a grammar's check, and reading and
        # processing images) runs on a worker thread: a long prompt must not stall the event loop,
        # which serves /health and every other client's stream.
        prepared = await asyncio.to_thread(self.chat_prepare, llm, req, self.allow_remote_images) if chat else None
        ids = prepared.prompt_ids if chat else await asyncio.to_thread(self.completion_prompt, llm, req)
        max_tokens = req.max_completion_tokens if chat and req.max_completion_tokens is not None else req.max_tokens
        params = self._params(m, req, len(ids), max_tokens, chat, prepared.params.structured if chat else None)
        check_queue(m.engine, self.max_queue)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        choices = [Choice(i, chat, llm.tokenizer, params.logprobs is not None, req.return_token_ids,
                          prepared.new_parser() if chat else None) for i in range(req.n)]
        streams = self._start(m.engine, ids, params, rid, req.n, prepared.mm if chat else None)
        try:
            # Wait for the engine to accept them (and for a first token) before committing to a 200.
            firsts = [await next_or_disconnect(s, http) for s in streams]
        except EngineDeadError as e:
            await close_streams(streams)
            raise engine_stopped(e) from None
        except InvalidGrammar as e:
            await close_streams(streams)
            field = _grammar_field(req)
            raise APIError(400, f"{field}: {e}", field, "invalid_value") from None
        except (MacinferError, ValueError) as e:
            await close_streams(streams)
            raise APIError(400, str(e), None, "invalid_request") from None
        if any(f is None for f in firsts):  # the client left during the prefill
            await close_streams(streams)
            return PlainTextResponse("", status_code=499)
        kind = "chat.completion" if chat else "text_completion"
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._sse(m.name, _merged(firsts, streams), streams, choices, rid, kind, include_usage)
            return StreamingResponse(body, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        for choice, first, stream in zip(choices, firsts, streams):
            d = first
            choice.add(d)
            while d.finish_reason is None:
                try:
                    d = await next_or_disconnect(stream, http)
                except EngineDeadError as e:
                    await close_streams(streams)
                    raise engine_stopped(e) from None
                if d is None:
                    await close_streams(streams)
                    return PlainTextResponse("", status_code=499)
                choice.add(d)
        outs = [c.output for c in choices]
        for out in outs:
            self.metrics.observe_request(out, "chat" if chat else "completions", m.name)
        return {"id": rid, "object": kind, "created": int(time.time()), "model": m.name,
                "choices": [c.final() for c in choices], "usage": self._usage(choices)}

    async def _sse(self, model: str, deltas, streams, choices, rid, kind, include_usage) -> AsyncIterator[str]:
        created = int(time.time())
        chat = kind == "chat.completion"
        obj = kind + ".chunk" if chat else kind

        def chunk(choice_objs: list[dict], usage: dict | None = None) -> str:
            c = {"id": rid, "object": obj, "created": created, "model": model, "choices": choice_objs}
            if include_usage:
                c["usage"] = usage
            return f"data: {json.dumps(c)}\n\n"

        try:
            if chat:
                for c in choices:
                    yield chunk([c.first_chunk()])
            try:
                async for i, d in deltas:
                    body = choices[i].add(d)
                    if body is not None:
                        yield chunk([body])
            except EngineDeadError as e:  # mid-reply: an error chunk, as vLLM sends (the openai client raises it)
                yield f"data: {json.dumps(engine_stopped(e).body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            outs = [c.output for c in choices]
            if include_usage:
                yield chunk([], self._usage(choices))
            yield "data: [DONE]\n\n"
            for out in outs:
                self.metrics.observe_request(out, "chat" if chat else "completions", model)
        finally:
            await deltas.aclose()
            await close_streams(streams)  # aborts the requests still running (client left)


def _logprobs(req: RequestBase, chat: bool) -> int | None:
    """How many top alternatives to report with each token's logprob; None: no logprobs."""
    if not chat:
        return None if req.logprobs is None or req.logprobs is False else int(req.logprobs)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {req.top_logprobs}",
                       "top_logprobs", "invalid_value")
    return (req.top_logprobs or 0) if req.logprobs else None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    try:
        return {int(k): v for k, v in (bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (integers as strings)", "logit_bias",
                       "invalid_value") from None


async def _merged(firsts: list, streams: list) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, delta) from every stream as they come; each stream's first delta is in hand.

    NOTE: each stream is read by its own task; cancelling a task aborts its request (the
    stream's generator sees the cancellation), so closing this iterator frees every request.
    """
    if len(streams) == 1:  # the common case, without tasks
        d = firsts[0]
        yield 0, d
        while d.finish_reason is None:
            d = await streams[0].__anext__()
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, d, stream):
        try:
            await queue.put((i, d))
            while d.finish_reason is None:
                d = await stream.__anext__()
                await queue.put((i, d))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, f, s)) for i, (f, s) in enumerate(zip(firsts, streams))]
    try:
        left = len(streams)
        while left:
            i, d = await queue.get()
            if isinstance(d, Exception):
                raise d
            left -= d.finish_reason is not None
            yield i, d
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


# Requests waiting for a place in the batch (beyond max_num_seqs running) at most; more get a 429.
MAX_QUEUE = 256


def create_app(llm, *, api_key: str | None = None, model_name: str | None = None, engine=None,
               max_body_bytes: int = MAX_BODY_BYTES, max_queue: int = MAX_QUEUE, health_auth: bool = False,
               lenient: bool = False, models: PoolOptions | None = None, allow_remote_images: bool = False,
               response_store: ResponseStore | None = None) -> FastAPI:
    """Build the FastAPI app serving `llm` (a macinfer.LLM), and with `models` others.

    Args:
        api_key: if set, every request must send `Authorization: Bearer <api_key>`.
        model_name: the name clients pass as `model` (default: the model's name); requests
            without a model get this one.
        engine: the engine to drive; default: the LLM's continuous-batching engine.
        models: further models, loaded on the first request naming them, and the budget they
            are loaded under (macinfer.serve.model_pool); None: `llm` alone.
        max_body_bytes: larger request bodies get a 413 (with or without a Content-Length).
        max_queue: requests waiting beyond the engine's max_num_seqs at most; more get a 429.
        lenient: accept and ignore unknown request fields (default: a 400 naming the field).
        health_auth: /health requires the API key too (by default it is open, for load balancers).
        allow_remote_images: image content parts may name http(s) URLs, fetched by the server.
        response_store: where /v1/responses keeps stored responses (default: in memory, the last 1,000).

    Raises:
        MacinferError: an empty api_key.
    """
    check_api_key(api_key)
    model_name = model_name or llm.info.name
    several = models is not None and (any(n != model_name for n in models.others) or models.discover is not None)
    metrics = ServerMetrics(model_label=several)
    ranks = getattr(llm, "ranks", None)  # across ranks: the idle engine thread keeps the others posted
    aengine = AsyncEngine(engine or llm.engine, on_step=functools.partial(metrics.observe_step, model=model_name),
                          on_idle=ranks.heartbeat if ranks is not None else None)
    aengine.engine.prepare()
    if models is not None and models.load is not None:  # and each model as it is loaded, on the loading thread
        models = dataclasses.replace(models, load=functools.partial(_load_prepared, models.load))

    def start_engine(name: str, other) -> AsyncEngine:
        return AsyncEngine(other.engine, on_step=functools.partial(metrics.observe_step, model=name)).start()

    pool = ModelPool(ServedModel(model_name, None, llm=llm, engine=aengine), start_engine, models)
    metrics.attach_pool(pool)
    server = Server(pool, metrics, max_queue=max_queue, lenient=lenient, allow_remote_images=allow_remote_images)
    keep_alive = ollama_models.KeepAlive(pool)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        pool.start()
        yield
        keep_alive.shutdown()
        pool.shutdown()

    app = FastAPI(title="macinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    add_error_handling(app, metrics, api_key, max_body_bytes, health_auth, shapes=ERROR_SHAPES)
    _add_routes(app, server)
    # The other protocols, each a thin adapter over the same request path (macinfer.serve.generation).
    responses.add_routes(app, server, response_store or ResponseStore(None))
    anthropic.add_routes(app, server)
    ollama.add_routes(app, server, keep_alive)
    ollama_models.add_routes(app, server, keep_alive)
    return app


def _grammar_field(req: RequestBase) -> str:
    """The request field that carried its grammar: response_format, a guided_* field, or tool_choice."""
    for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(req, name, None)
        if value is not None and not (name == "response_format" and value.type == "text"):
            return name
    return "tool_choice"


# Route prefix -> the error body of the protocol served there (OpenAI's elsewhere, /v1/responses included).
ERROR_SHAPES = {"/v1/messages": anthropic.error_response, "/api/": ollama.error_response}


def _load_prepared(load, spec: str):
    """Load a model and build what its engine's first request would otherwise build (Engine.prepare)."""
    llm = load(spec)
    llm.engine.prepare()
    return llm


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
        return {"object": "list", "data": [m.card(server.created) for m in await server.pool.listing()]}

    @app.get("/health")
    async def health():
        if not server.engine.is_running:
            return JSONResponse({"status": "error", "error": str(server.engine.error)}, status_code=503)
        loaded = server.pool.loaded()
        body = {"status": "ok", "model": server.model_name, "running_requests": sum(m.engine.num_active for m in loaded)}
        return body | ({"loaded_models": [m.name for m in loaded]} if server.pool.several else {})

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
