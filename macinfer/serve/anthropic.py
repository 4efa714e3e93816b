"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), a thin adapter
over the chat request path (macinfer.serve.generation).

    request  ──▶ ChatRequest: `system` the system message; each message's content blocks: text,
                 `tool_use` (an assistant's tool_calls), `tool_result` (tool messages), `thinking`
                 (the assistant turn's thought); custom `tools` (`input_schema`), `tool_choice`
                 auto / any / tool / none, `thinking` enabled / disabled, `output_config`
                 (`format` a JSON schema held by the grammar, `effort`)
    events   ──▶ content blocks: thinking, text, tool_use, streamed as Anthropic streams them:
                 message_start, ping, content_block_start / content_block_delta (text_delta,
                 thinking_delta, input_json_delta) / content_block_stop, message_delta
                 (stop_reason, usage), message_stop

stop_reason: end_turn, max_tokens, tool_use (the model called a tool and stopped), or
stop_sequence with the `stop_sequence` that matched. Usage counts as Anthropic's: `input_tokens`
are the prompt tokens not read from the prefix cache, `cache_read_input_tokens` those that were.
Errors are Anthropic's body ({"type": "error", "error": {"type", "message"}}, `error_response`),
and the API key may come as `x-api-key` (macinfer.serve.guard).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from macinfer.chat.events import ContentDelta, Finish, ThinkingDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from macinfer.chat.request import ChatRequest
from macinfer.serve.generation import Generation, Route, chat_prepared, held, no_media
from macinfer.serve.images import image_part
from macinfer.serve.schemas import APIError, check_known

ROUTE = Route("anthropic", "messages")
NAMES = {"stop": "stop_sequences", "response_format": "output_config.format"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def error_body(e: APIError) -> dict:
    """Anthropic's error body: {"type": "error", "error": {"type": "invalid_request_error", "message": ...}}."""
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


# -- the request ------------------------------------------------------------------------------
class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # Accepted, and they change nothing here (the prefix cache works without cache_control).
    cache_control: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    service_tier: str | None = None
    metadata: dict[str, Any] | None = None
    # Refused when set: nothing here does them.
    container: Any = None
    mcp_servers: list[Any] | None = None
    context_management: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """The fields served; unknown ones are a 400 naming them (unless --lenient). The sampling
    fields are older clients' (Anthropic's SDK no longer sends them; `extra_body` does)."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # an extension, as vLLM's: reproducible sampling
    stream: bool = False


def check_supported(req: CountTokensRequest) -> None:
    for param in ("container", "mcp_servers", "context_management"):
        if getattr(req, param) is not None:
            raise APIError(400, f"{param} is not supported by this server", param, "unsupported_parameter")


def chat_request(req: CountTokensRequest) -> ChatRequest:
    """The ChatRequest a Messages request asks for.

    Raises:
        APIError: 400 naming the field (`messages[1].content[0].type`, `tools[0]`, `tool_choice.name`, ...).
    """
    system = _text(req.system, "system") if req.system is not None else ""
    messages = ([{"role": "system", "content": system}] if system else []) + chat_messages(req.messages)
    choice, parallel = chat_tool_choice(req.tool_choice)
    fmt, effort = output_config(req.output_config)
    return ChatRequest(messages, tools=chat_tools(req.tools), tool_choice=choice, parallel_tool_calls=parallel,
                       response_format=fmt, enable_thinking=thinking(req.thinking), reasoning_effort=effort)


def chat_messages(messages: list[Message]) -> list[dict]:
    """Content blocks as chat messages: a user's tool_result blocks become tool messages (before its
    text), an assistant's tool_use blocks its tool_calls and its thinking blocks its thought."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, thought, results = [], [], [], []  # texts: text and image parts in chat's shape
        shown = []  # the image parts of this message's tool results (a screenshot, a file read)
        for j, block in enumerate(m.content):
            kind, at = block.get("type"), f"{where}[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and m.role == "user":
                texts.append(image_part(_image_url(block, at), at))
            elif kind == "document":
                raise no_media(at, "document")
            elif kind == "tool_use" and m.role == "assistant":
                calls.append({"id": _field(block, "id", at, str), "type": "function",
                              "function": {"name": _field(block, "name", at, str),
                                           "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and m.role == "user":
                text = _text(block.get("content"), f"{at}.content", images=shown)
                results.append({"role": "tool", "tool_call_id": _field(block, "tool_use_id", at, str),
                                "content": f"Error: {text}" if block.get("is_error") else text})
            elif kind == "thinking" and m.role == "assistant":
                thought.append(_field(block, "thinking", at, str))
            elif kind != "redacted_thinking":  # an opaque thought of Claude's: nothing to render
                raise APIError(400, f"{at}.type {kind!r} is not supported in a {m.role} message", f"{at}.type",
                               "invalid_value")
        if m.role == "user":
            # A tool result's images follow the results in a user turn of their own: a tool message holds
            # text only in chat templates (and in the generic tool format, a JSON string).
            texts = shown + texts
            out += results + ([{"role": "user", "content": _joined(texts)}] if texts or not results else [])
        else:
            message = {"role": "assistant", "content": _joined(texts)}
            out.append(message | ({"tool_calls": calls} if calls else {})
                       | ({"reasoning_content": "".join(thought)} if thought else {}))
    return out


def _joined(parts: list[dict]) -> str | list[dict]:
    """Text parts as one string; with an image among them, the parts as they are."""
    if any(p["type"] != "text" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _image_url(block: dict, where: str) -> str:
    """An image block's source as a URL macinfer.serve.images reads: base64 data as a data URL, a url as it is."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type")
        media = media if isinstance(media, str) and media.startswith("image/") else "image/png"
        return f"data:{media};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise APIError(400, f"{where}.source: an image's source is base64 data or a url (file sources are not supported)",
                   f"{where}.source")


def _field(block: dict, key: str, where: str, kind: type):
    value = block.get(key)
    if not isinstance(value, kind):
        raise APIError(400, f"{where}.{key}: " + ("field required" if value is None else f"must be a {kind.__name__}"),
                       f"{where}.{key}")
    return value


def _text(content, where: str, images: list | None = None) -> str:
    """A string, or text blocks joined (a system prompt); with `images` (a tool result), image blocks
    are appended there as image parts, else refused."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content blocks", where)
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "image" and images is not None:
            images.append(image_part(_image_url(block, f"{where}[{j}]"), f"{where}[{j}]"))
            continue
        if kind in ("image", "document"):
            raise APIError(400, f"{where}[{j}]: {kind} blocks are taken in a user message or a tool result only",
                           f"{where}[{j}]")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}[{j}]: only text blocks are supported here, got {kind!r}", f"{where}[{j}]")
        texts.append(block["text"])
    return "".join(texts)


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Custom tools ({"name", "description", "input_schema"}) in chat's shape; Anthropic's server
    tools (web search, bash, ...) are refused."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") not in (None, "custom"):
            raise APIError(400, f"tools[{i}].type {t.get('type')!r} is not supported: only custom tools "
                                "(name, input_schema) are served here", f"tools[{i}].type")
        if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
            raise APIError(400, f"tools[{i}] needs a name and an input_schema", f"tools[{i}]")
        f = {"name": t["name"], "parameters": t["input_schema"]}
        out.append({"type": "function", "function": f | ({"description": t["description"]}
                                                          if t.get("description") else {})})
    return out


def chat_tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) for auto / any / tool / none."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, "tool_choice.type must be auto, any, none, or tool (with a name)", "tool_choice")


def thinking(config: dict | None) -> bool | None:
    """enabled: think; disabled: do not; adaptive, between_tools or absent: the model's own default.
    NOTE: budget_tokens is not enforced (max_tokens bounds the thought and the answer together)."""
    kind = config.get("type") if config is not None else None
    if kind in (None, "adaptive", "between_tools"):
        return None
    if kind in ("enabled", "disabled"):
        return kind == "enabled"
    raise APIError(400, "thinking.type must be enabled, disabled, adaptive or between_tools", "thinking.type")


def output_config(config: dict | None) -> tuple[dict | None, str | None]:
    """(chat's response_format, reasoning effort) from `output_config` {"format": {"type": "json_schema",
    "schema"}, "effort"}."""
    config = config or {}
    fmt = config.get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "json_schema"
                            or not isinstance(fmt.get("schema"), dict)):
        raise APIError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       "output_config.format")
    rf = {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}} if fmt is not None else None
    return rf, config.get("effort")


def sampling(req: MessagesRequest) -> dict:
    return {"temperature": 1.0 if req.temperature is None else req.temperature, "top_p": req.top_p,
            "top_k": req.top_k, "seed": req.seed, "max_tokens": req.max_tokens, "stop": req.stop_sequences}


# -- the reply -----------------------------------------------------------------------------------
class ContentBlocks:
    """A reply's content blocks as the events come, with the streaming events for each change."""

    def __init__(self):
        self.blocks: list[dict] = []
        self.finish: Finish | None = None
        self._open: dict | None = None

    def add(self, event) -> list[dict]:
        if isinstance(event, ThinkingDelta):
            return self._delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                               {"type": "thinking_delta", "thinking": event.text})
        if isinstance(event, ContentDelta):
            return self._delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": event.text})
        if isinstance(event, ToolCallStart):
            return self._close() + self._opened({"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
        if isinstance(event, ToolCallDelta):
            delta = {"type": "input_json_delta", "partial_json": event.arguments}
            return [self._event("content_block_delta", delta=delta)]
        if isinstance(event, ToolCallEnd):
            try:
                self._open["input"] = json.loads(event.arguments) if event.arguments.strip() else {}
            except json.JSONDecodeError:
                self._open["input"] = {}
            return self._close()
        if isinstance(event, Finish):
            self.finish = event
            return self._close()
        return []

    def _delta(self, kind: str, block: dict, delta: dict) -> list[dict]:
        out = []
        if self._open is None or self._open["type"] != kind:
            out = self._close() + self._opened(block)
        key = "text" if kind == "text" else "thinking"
        self._open[key] += delta[key]
        return out + [self._event("content_block_delta", delta=delta)]

    def _opened(self, block: dict) -> list[dict]:
        self.blocks.append(block)
        self._open = block
        return [self._event("content_block_start", content_block=dict(block))]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [self._event("content_block_stop")]

    def _event(self, kind: str, **fields) -> dict:
        return {"type": kind, "index": len(self.blocks) - 1, **fields}


def stop_reason(gen: Generation, finish: Finish, stops: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a stop on "stop" is a stop sequence when one follows the text."""
    if finish.reason == "stop" and stops and gen.output is not None:
        # NOTE: the engine cuts the text before the stop string it met, not the tokens holding it.
        tail = gen.model.llm.tokenizer.decode(gen.output.token_ids)[len(gen.output.text):]
        for s in sorted(stops, key=len, reverse=True):
            if s and tail.startswith(s):
                return "stop_sequence", s
    return STOP_REASONS.get(finish.reason, "end_turn"), None


def usage(finish: Finish | None, prompt_tokens: int) -> dict:
    u = finish.usage if finish is not None else None
    cached = u.cached_tokens if u is not None else 0
    return {"input_tokens": prompt_tokens - cached, "output_tokens": u.completion_tokens if u is not None else 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


class Messages:
    """The Messages routes' work: one request through a Generation."""

    def __init__(self, server):
        self.server = server

    async def create(self, req: MessagesRequest, http: Request):
        check_known(req, self.server.lenient)
        check_supported(req)
        gen = await Generation.start(self.server, http, req.model, ROUTE, chat=chat_request(req),
                                     sampling=sampling(req), names=NAMES)
        if gen is None:
            return PlainTextResponse("", status_code=499)
        mid = "msg_" + uuid.uuid4().hex[:24]
        blocks = ContentBlocks()
        if req.stream:
            return StreamingResponse(self._sse(gen, req, mid, blocks), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for event in gen.events():
            blocks.add(event)
        if gen.output is None:
            return PlainTextResponse("", status_code=499)
        reason, sequence = stop_reason(gen, blocks.finish, req.stop_sequences)
        return self._message(mid, gen, blocks.blocks, reason, sequence, usage(blocks.finish, len(gen.prompt_ids)))

    @staticmethod
    def _message(mid, gen, content, reason, sequence, use) -> dict:
        return {"id": mid, "type": "message", "role": "assistant", "model": gen.model.name, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": use}

    async def _sse(self, gen: Generation, req: MessagesRequest, mid: str, blocks: ContentBlocks):
        def sse(event: dict) -> str:
            return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

        start = self._message(mid, gen, [], None, None, usage(None, len(gen.prompt_ids)))
        yield sse({"type": "message_start", "message": start})
        yield sse({"type": "ping"})
        try:
            async for event in gen.events(watch_disconnect=False):
                for e in blocks.add(event):
                    yield sse(e)
        except APIError as e:  # the engine stopped mid-reply: Anthropic's error event (its client raises it)
            yield sse(error_body(e))
            return
        reason, sequence = stop_reason(gen, blocks.finish, req.stop_sequences)
        yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                   "usage": usage(blocks.finish, len(gen.prompt_ids))})
        yield sse({"type": "message_stop"})

    async def count_tokens(self, req: CountTokensRequest) -> dict:
        """The prompt's tokens as the request would render it (its template, tools and thinking)."""
        check_known(req, self.server.lenient)
        check_supported(req)
        chat = chat_request(req)
        async with held(self.server.pool, req.model) as m:
            prepared = await asyncio.to_thread(chat_prepared, m.llm, chat, NAMES, self.server.allow_remote_images)
        return {"input_tokens": len(prepared.prompt_ids)}


def add_routes(app: FastAPI, server) -> None:
    """POST /v1/messages and /v1/messages/count_tokens."""
    messages = Messages(server)

    @app.post("/v1/messages")
    async def create(body: MessagesRequest, request: Request):
        return await messages.create(body, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        return await messages.count_tokens(body)
