"""One reply on the engine, for any protocol: the model held, the request prepared, the engine's
deltas read as chat events, the finished request counted in the metrics.

    gen = await Generation.start(server, http, "smollm2", Route("anthropic", "messages"),
                                 chat=ChatRequest(messages, tools=...), sampling={"temperature": 0.7})
    async for event in gen.events():        # macinfer.chat.events: ThinkingDelta, ContentDelta,
        ...                                 # ToolCallStart / Delta / End, Finish (with the usage)

The protocol adapters (macinfer.serve.responses, .anthropic, .ollama) translate their request
into a ChatRequest (or a raw prompt) and SamplingParams' fields, and render the events in their
protocol's shapes. Everything below that is done here once, as chat completions do it
(macinfer.serve.server): the chat template, thinking split, tool parsing and grammars
(macinfer.chat.request.prepare), the sampling checks (SamplingParams), the context and queue
limits, a client's disconnect (the request is aborted), and the metrics, labelled by protocol.

Errors are APIErrors naming the field in the protocol's own words: `names` maps the internal
names (`max_tokens`, `response_format`, `tool_choice`, ...) to the protocol's (`max_output_tokens`,
`text.format`, ...); the protocol's error shape is chosen by route (macinfer.serve.guard).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import Request

from macinfer.chat.output import OutputParser
from macinfer.chat.request import ChatRequest, ChatRequestError, PreparedChat, prepare
from macinfer.core.sampling_params import SamplingParams
from macinfer.errors import InvalidGrammar, MacinferError
from macinfer.serve.async_engine import AsyncEngine, EngineDeadError
from macinfer.serve.images import has_images, image_messages
from macinfer.serve.model_pool import ModelPool, ServedModel
from macinfer.serve.schemas import APIError

RETRY_AFTER_SECONDS = 1  # what a 429 tells the client to wait


@dataclass(frozen=True)
class Route:
    """Which protocol and endpoint a request came through (the metrics' labels)."""

    protocol: str  # "openai", "responses", "anthropic", "ollama"
    endpoint: str  # "chat", "completions", "responses", "messages", "api/chat", "api/generate"


@contextlib.asynccontextmanager
async def held(pool: ModelPool, name: str | None) -> AsyncIterator[ServedModel]:
    """The model `name` names, loaded and held while the block runs (404 before any load)."""
    await pool.lookup(name)
    m = await pool.acquire(name)
    try:
        yield m
    finally:
        pool.release(m)


def no_media(param: str, kind: str) -> APIError:
    """The one refusal of a content part no model here reads (files, documents, audio)."""
    return APIError(400, f"{param}: {kind} parts are not supported: send text or images", param, "unsupported_content")


def renamed(e: APIError, names: dict[str, str]) -> APIError:
    """`e` with its param in the protocol's words: the param's first name looked up in `names`."""
    if e.param is None:
        return e
    root = e.param.split("[", 1)[0].split(".", 1)[0]
    if root in names:
        e.param = names[root] + e.param[len(root):]
        e.message = e.message.replace(root, names[root], 1) if e.message.startswith(root) else e.message
    return e


def chat_prepared(llm, chat: ChatRequest, names: dict[str, str] | None = None,
                  allow_remote_images: bool = False) -> PreparedChat:
    """macinfer.chat's prepare on `llm`'s tokenizer (prompt ids and images, grammar, parser), its
    errors as APIErrors. Image parts in the messages (macinfer.serve.images.image_part) are read
    and handed to the model's processor.

    Raises:
        APIError: 400 naming the field; 500 when the model's own format cannot be read here.
    """
    pictures = None
    if has_images(chat.messages):
        messages, pictures = image_messages(llm, chat.messages, allow_remote_images)
        chat = dataclasses.replace(chat, messages=messages)
    try:
        return prepare(llm.tokenizer, chat, images=pictures, vision=llm.images)
    except ChatRequestError as e:
        raise renamed(APIError(400, str(e), e.param, "invalid_value"), names or {}) from None
    except MacinferError as e:  # the model's format cannot be read here: not the request's fault
        raise APIError(500, str(e), None, "model_format_unavailable", "server_error") from None


def sampling_params(m: ServedModel, num_prompt: int, fields: dict[str, Any], structured=None,
                    names: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams from a protocol's sampling fields, checked against the model's context.

    Args:
        fields: SamplingParams' fields; a missing or None `max_tokens` is what the context leaves.
        structured: the reply's grammar (PreparedChat.params.structured), or None.

    Raises:
        APIError: 400 naming the field (in the protocol's words, through `names`).
    """
    ctx = m.llm.info.context_length
    names = names or {}
    if num_prompt >= ctx:
        raise renamed(APIError(400, f"the prompt is {num_prompt} tokens but {m.name} holds at most {ctx}: shorten it",
                               "messages", "context_length_exceeded"), names)
    fields = {k: v for k, v in fields.items() if v is not None}
    fields.setdefault("max_tokens", ctx - num_prompt)
    try:
        return SamplingParams(**fields, structured=structured)
    except ValueError as e:
        msg = str(e)
        raise renamed(APIError(400, msg, msg.split(" ", 1)[0], "invalid_value"), names) from None


def check_queue(engine: AsyncEngine, max_queue: int) -> None:
    """429 when max_queue requests already wait beyond the engine's max_num_seqs running ones."""
    waiting = engine.num_active - engine.engine.max_num_seqs
    if waiting >= max_queue:
        raise APIError(429, f"the server is busy: {waiting} requests are waiting (at most {max_queue}, "
                            "--max-queue): retry later", None, "queue_full", "server_error",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


class Generation:
    """One reply running on its model's engine; `events()` reads it (once).

    After the events end, `output` is the engine's RequestOutput (None: the client left first,
    and the request was aborted).
    """

    def __init__(self, server, http: Request, route: Route, m: ServedModel, prompt_ids: list[int],
                 params: SamplingParams, parser: OutputParser, stream, first):
        self.server, self.http, self.route = server, http, route
        self.model, self.prompt_ids, self.params, self.parser = m, prompt_ids, params, parser
        self._stream, self._first = stream, first
        self.output = None

    @classmethod
    async def start(cls, server, http: Request, model: str | None, route: Route, *, chat: ChatRequest | None = None,
                    prompt: str | None = None, structured=None, sampling: dict[str, Any],
                    names: dict[str, str] | None = None,
                    check: Callable[[ServedModel], None] | None = None) -> "Generation | None":
        """Prepare the request on its model and wait for the engine to take it (and give a first delta).

        Args:
            server: the app's Server (its pool, metrics and max_queue).
            chat: a chat reply to generate (its messages may hold image parts: macinfer.serve.images);
                or `prompt`, raw text continued as it is (no template).
            structured: the raw prompt's grammar (a chat request's comes from macinfer.chat).
            sampling: SamplingParams' fields (sampling_params).
            check: called with the held model before anything else (a protocol's own refusals).

        Returns:
            The Generation, or None when the client left before its first delta.

        Raises:
            APIError: the request cannot be served (4xx naming the field, 429, 503).
        """
        names = names or {}
        async with held(server.pool, model) as m:
            if check is not None:
                check(m)
            llm = m.llm
            # NOTE: the template, tokenising and compiling a grammar run on a worker thread: a long
            # prompt must not stall the event loop, which serves every other client's stream.
            if chat is not None:
                prepared = await asyncio.to_thread(chat_prepared, llm, chat, names, server.allow_remote_images)
                ids, structured, parser = prepared.prompt_ids, prepared.params.structured, prepared.new_parser()
                mm = prepared.mm
            else:
                ids = await asyncio.to_thread(_encoded, llm, prompt, names)
                parser, mm = OutputParser(llm.tokenizer, None, False, None, None, len(ids)), None
            params = sampling_params(m, len(ids), sampling, structured, names)
            check_queue(m.engine, server.max_queue)
            stream = m.engine.generate(ids, params, request_id=f"{route.protocol}-{uuid.uuid4().hex[:24]}", mm=mm)
            grammar = "tool_choice" if chat is not None and chat.response_format is None else "response_format"
            first = await _first_delta(stream, http, names.get(grammar, grammar))
            return None if first is None else cls(server, http, route, m, ids, params, parser, stream, first)

    async def events(self, watch_disconnect: bool = True) -> AsyncIterator[Any]:
        """The reply's events as the engine makes them; Finish last.

        Args:
            watch_disconnect: look for the client leaving between deltas (a non-streamed reply;
                a streamed one is cancelled by its response when the client leaves).

        Raises:
            APIError: 503, the engine stopped mid-reply (each protocol's stream ends with its own
                error event then).
        """
        d = self._first
        try:
            while True:
                for event in self.parser.feed(d):
                    yield event
                if d.finish_reason is not None:
                    break
                try:
                    d = await (next_or_disconnect(self._stream, self.http) if watch_disconnect
                               else self._stream.__anext__())
                except EngineDeadError as e:  # mid-reply: the protocol says so in its own shape
                    raise engine_stopped(e) from None
                if d is None:
                    return
            self.output = d.output
            self.server.metrics.observe_request(d.output, self.route.endpoint, self.model.name, self.route.protocol)
        finally:
            await self._stream.aclose()  # aborts the request if it is still running (the client left)


async def _first_delta(stream, http: Request, grammar_field: str):
    """The engine's first delta (None: the client left first); what the engine refused as an APIError.

    Args:
        grammar_field: the request's field that carried its grammar, for a grammar the engine refuses.
    """
    try:
        return await next_or_disconnect(stream, http)
    except EngineDeadError as e:
        await stream.aclose()
        raise engine_stopped(e) from None
    except InvalidGrammar as e:  # a schema admitting no reply, found when the engine compiled it
        await stream.aclose()
        raise APIError(400, f"{grammar_field}: {e}", grammar_field, "invalid_value") from None
    except (MacinferError, ValueError) as e:
        await stream.aclose()
        raise APIError(400, str(e), None, "invalid_request") from None


def engine_stopped(e: EngineDeadError) -> APIError:
    """The engine stopped before or during a reply: a 503 (a stream that started says it in its own events)."""
    return APIError(503, str(e), None, "engine_unavailable", "server_error")


def _encoded(llm, prompt: str, names: dict[str, str]) -> list[int]:
    try:
        return llm.encode(prompt)
    except MacinferError as e:
        raise renamed(APIError(400, str(e), "prompt"), names) from None


async def close_streams(streams: list) -> None:
    for s in streams:
        await s.aclose()


async def next_or_disconnect(deltas, http: Request, poll: float = 0.5):
    """The next delta, or None if the client disconnects first (the request is then aborted)."""
    task = asyncio.ensure_future(deltas.__anext__())
    try:
        while True:
            # NOTE: checked before every wait, not only after `poll` seconds without a delta: a
            # non-streaming request decoding steadily never waits that long.
            if await http.is_disconnected():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                await deltas.aclose()
                return None
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
    except asyncio.CancelledError:
        task.cancel()
        await deltas.aclose()
        raise
