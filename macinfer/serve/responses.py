"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`), a thin
adapter over the chat request path (macinfer.serve.generation).

    request  ──▶ ChatRequest: `instructions` the system message, `input` (a string, or message /
                 function_call / function_call_output / reasoning items) the conversation after
                 the stored one `previous_response_id` names; function `tools`, `tool_choice`,
                 `text.format` (json_schema / json_object), `reasoning.effort`
    events   ──▶ output items: reasoning, message, function_call (macinfer.serve.response_items),
                 streamed as Responses' semantic events (response.created, ...output_text.delta,
                 ...function_call_arguments.delta, ...reasoning_text.delta, response.completed)

`store` (true unless false is sent, as OpenAI's) keeps the response and its conversation in the
ResponseStore, so the next turn sends only its new input with `previous_response_id`; that turn's
prompt renders the same conversation again, and its KV comes from the prefix cache. Errors are
OpenAI's error body; a field is named as the Responses API names it (`max_output_tokens`,
`text.format`, `input`).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from macinfer.chat.request import ChatRequest
from macinfer.serve.generation import Generation, Route, no_media
from macinfer.serve.images import image_part
from macinfer.serve.response_items import OutputItems, item_id
from macinfer.serve.response_store import ResponseStore
from macinfer.serve.schemas import APIError, check_known

ROUTE = Route("responses", "responses")
# Internal names -> the Responses API's, for errors.
NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
MEDIA_PARTS = {"input_file": "file", "input_audio": "audio"}


# -- the request ------------------------------------------------------------------------------
class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None
    verbosity: str | None = None  # accepted; changes nothing here


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the older name of summary


class ResponsesRequest(BaseModel):
    """The fields served; unknown ones are a 400 naming them (unless --lenient)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None  # OpenAI's ranges: checked by SamplingParams, as for chat completions
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    # vLLM's extensions
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    # Accepted, and they change nothing here (OpenAI's bookkeeping; `truncation` "auto" cannot
    # drop items here: a conversation over the context is a 400 either way).
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    # Refused when set: nothing here does them.
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None


def check_supported(req: ResponsesRequest) -> None:
    refused = [(req.background, "background", "background responses are not supported: send the request and wait"),
               (req.conversation is not None, "conversation",
                "conversations are not supported: continue with previous_response_id"),
               (req.prompt is not None, "prompt", "stored prompt templates are not supported: send input"),
               (bool(req.top_logprobs), "top_logprobs", "top_logprobs is not supported on /v1/responses")]
    for bad, param, msg in refused:
        if bad:
            raise APIError(400, msg, param, "unsupported_parameter")


# -- request -> the one chat request ------------------------------------------------------------
def chat_request(req: ResponsesRequest, conversation: list[dict]) -> ChatRequest:
    """The ChatRequest a Responses request asks for: `instructions`, then `conversation` (the
    stored one `previous_response_id` names, and `input`).

    Raises:
        APIError: 400 naming the field (`tools[0].type`, `tool_choice`, `text.format.schema`, ...).
    """
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    fmt = req.text.format if req.text is not None else None
    effort = req.reasoning.effort if req.reasoning is not None else None
    return ChatRequest(system + conversation, tools=chat_tools(req.tools),
                       tool_choice=chat_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
                       response_format=response_format(fmt), reasoning_effort=effort)


def input_messages(items: str | list[dict]) -> list[dict]:
    """`input` as chat messages: function_call items join the assistant turn before them, a
    reasoning item becomes the thought of the assistant turn after it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    thought = None
    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant, got {role!r}",
                               f"{where}.role", "invalid_value")
            message = {"role": "system" if role == "developer" else role,
                       "content": _content(item.get("content"), f"{where}.content", images=role == "user")}
            if role == "assistant" and thought:
                message["reasoning_content"], thought = thought, None
            out.append(message)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant" and not thought:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]}
                           | ({"reasoning_content": thought} if thought else {}))
                thought = None
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thought = (thought or "") + _text(parts, f"{where}.content")
        else:
            raise APIError(400, f"{where}.type {kind!r} is not supported: send message, function_call, "
                                "function_call_output or reasoning items", f"{where}.type", "invalid_value")
    return out


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string" + (" (it is missing)" if value is None else ""),
                       f"{where}.{key}", "invalid_value" if value is not None else "missing_required_parameter")
    return value


def _content(content, where: str, images: bool) -> str | list[dict]:
    """A message's content: its text, or (with `input_image` parts, in a user message) text and image
    parts in chat's shape (macinfer.serve.images.image_part)."""
    if not images or not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        return _text(content, where)
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise APIError(400, f"{where}[{j}].image_url: an input_image needs image_url (a data URL, a path or "
                                    "an http URL; file_id is not supported)", f"{where}[{j}].image_url", "invalid_value")
            parts.append(image_part(url, f"{where}[{j}]"))
        else:
            parts.append({"type": "text", "text": _text_part(part, f"{where}[{j}]")})
    return parts


def _text(content, where: str) -> str:
    """A content field's text: a string, or text parts joined (other parts are refused)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", where, "invalid_type")
    return "".join(_text_part(part, f"{where}[{j}]") for j, part in enumerate(content))


def _text_part(part, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in MEDIA_PARTS:
        raise no_media(where, MEDIA_PARTS[kind])
    if kind == "input_image":
        raise APIError(400, f"{where}: images are taken in user messages only", where, "invalid_value")
    if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
        raise APIError(400, f"{where}: a content part is text or an image, got {kind!r}", where, "invalid_value")
    return part["text"]


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' function tools ({"type": "function", "name", "parameters", ...}) in chat's shape."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise APIError(400, f"tools[{i}].type {t.get('type')!r} is not supported: only function tools are "
                                "served here", f"tools[{i}].type", "invalid_value")
        if not isinstance(t.get("name"), str):
            raise APIError(400, f"tools[{i}].name is required", f"tools[{i}].name", "missing_required_parameter")
        f = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": f | ({"description": t["description"]}
                                                          if t.get("description") else {})})
    return out


def chat_tool_choice(choice):
    """"auto" / "none" / "required" as they are; {"type": "function", "name": f} in chat's shape."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                   "tool_choice", "invalid_value")


def response_format(fmt: TextFormat | None) -> dict | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise APIError(400, "text.format.schema is required for type json_schema", "text.format.schema",
                       "missing_required_parameter")
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}


def sampling(req: ResponsesRequest) -> dict:
    return {"temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "top_k": req.top_k, "min_p": req.min_p,
            "seed": req.seed, "max_tokens": req.max_output_tokens}


# -- the response -------------------------------------------------------------------------------
def response_object(rid: str, req: ResponsesRequest, model: str, created: int, items: OutputItems | None,
                    stored: bool) -> dict:
    """The Response: in progress (items None or unfinished), completed, or incomplete (out of tokens)."""
    finish = items.finish if items is not None else None
    status = "in_progress" if finish is None else "incomplete" if finish.reason == "length" else "completed"
    usage = None
    if finish is not None:
        u = finish.usage
        usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                 "output_tokens": u.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
                 "total_tokens": u.prompt_tokens + u.completion_tokens}
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
        {"type": "text"}
    reasoning = req.reasoning.model_dump(exclude_none=True) if req.reasoning is not None else {}
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
            "output": items.items if items is not None else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": reasoning.get("effort"),
                          "summary": reasoning.get("summary", reasoning.get("generate_summary"))},
            "store": stored, "temperature": sampling(req)["temperature"], "text": {"format": fmt},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": sampling(req)["top_p"],
            "truncation": req.truncation or "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {}}


class Responses:
    """The Responses routes' work: one request through a Generation, its response stored."""

    def __init__(self, server, store: ResponseStore):
        self.server, self.store = server, store

    def previous(self, req: ResponsesRequest) -> list[dict]:
        """The stored conversation `previous_response_id` continues ([] for none)."""
        if req.previous_response_id is None:
            return []
        record = self.store.get(req.previous_response_id)
        if record is None:
            kept = "" if self.store.limit else " (this server stores none: --max-stored-responses 0)"
            raise APIError(400, f"previous response '{req.previous_response_id}' not found{kept}: send the whole "
                                "conversation as input", "previous_response_id", "previous_response_not_found")
        return record["messages"]

    async def create(self, req: ResponsesRequest, http: Request):
        check_known(req, self.server.lenient)
        check_supported(req)
        conversation = await asyncio.to_thread(self.previous, req) + input_messages(req.input)
        chat = chat_request(req, conversation)
        gen = await Generation.start(self.server, http, req.model, ROUTE, chat=chat, sampling=sampling(req),
                                     names=NAMES)
        if gen is None:  # the client left during the prefill
            return PlainTextResponse("", status_code=499)
        rid, created = item_id("resp"), int(time.time())
        stored = req.store and self.store.limit > 0
        items = OutputItems(summary=req.reasoning is not None and bool(req.reasoning.summary or
                                                                      req.reasoning.generate_summary))
        if req.stream:
            return StreamingResponse(self._sse(gen, req, rid, created, items, stored, conversation),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for event in gen.events():
            items.add(event)
        if gen.output is None:
            return PlainTextResponse("", status_code=499)
        body = response_object(rid, req, gen.model.name, created, items, stored)
        await asyncio.to_thread(self._store, stored, body, conversation, items)
        return body

    async def _sse(self, gen: Generation, req, rid, created, items: OutputItems, stored, conversation):
        seq = 0

        def sse(event: dict) -> str:
            nonlocal seq
            event["sequence_number"], seq = seq, seq + 1
            return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

        start = response_object(rid, req, gen.model.name, created, None, stored)
        yield sse({"type": "response.created", "response": start})
        yield sse({"type": "response.in_progress", "response": start})
        try:
            async for event in gen.events(watch_disconnect=False):
                for e in items.add(event):
                    yield sse(e)
        except APIError as e:  # the engine stopped mid-reply: failed, as OpenAI ends a response it could not finish
            failed = response_object(rid, req, gen.model.name, created, None, False)
            failed.update(status="failed", error={"code": "server_error", "message": e.message}, output=items.items)
            yield sse({"type": "response.failed", "response": failed})
            return
        body = response_object(rid, req, gen.model.name, created, items, stored)
        await asyncio.to_thread(self._store, stored, body, conversation, items)
        yield sse({"type": "response.incomplete" if body["status"] == "incomplete" else "response.completed",
                   "response": body})

    def _store(self, stored: bool, body: dict, conversation: list[dict], items: OutputItems):
        """Keep the response and its conversation (without the instructions: OpenAI does not carry them over).

        NOTE: the store's reads and writes (an fsync among them) run on worker threads, off the event loop.
        """
        if stored:
            self.store.put(body["id"], {"response": body, "messages": conversation + [items.as_message()]})

    def get(self, rid: str) -> dict:
        record = self.store.get(rid)
        if record is None:
            raise APIError(404, f"no stored response '{rid}'", "response_id", "not_found")
        return record["response"]

    def delete(self, rid: str) -> dict:
        if not self.store.delete(rid):
            raise APIError(404, f"no stored response '{rid}'", "response_id", "not_found")
        return {"id": rid, "object": "response", "deleted": True}


def add_routes(app: FastAPI, server, store: ResponseStore) -> None:
    """POST /v1/responses, GET and DELETE /v1/responses/{id}."""
    responses = Responses(server, store)

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        return await responses.create(body, request)

    @app.get("/v1/responses/{response_id}")
    def get(response_id: str):  # plain functions: FastAPI runs them on its thread pool (the store's disk reads)
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    def delete(response_id: str):
        return responses.delete(response_id)
