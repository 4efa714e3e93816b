"""Ollama's API, the replies: `POST /api/chat` and `/api/generate`, a thin adapter over the chat
request path (macinfer.serve.generation). The models' routes (tags, show, ps, pull, delete, ...)
are macinfer.serve.ollama_models'.

    /api/chat      messages (thinking, tool_calls and tool results included), tools, `format`
                   ("json" or a JSON schema), `think` (true / false, or gpt-oss's low / medium /
                   high) -> a ChatRequest
    /api/generate  `prompt` (and `system`) through the chat template, or with `raw` continued as
                   it is
    `options`      mapped to sampling: temperature, top_p, top_k, min_p, seed, num_predict, stop,
                   repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty; the
                   runtime ones (num_ctx, num_gpu, num_thread, ...) accepted and ignored; mirostat,
                   typical_p and tfs_z refused unless they are off
    `keep_alive`   0 unloads the model after the reply, a duration after that long idle, a
                   negative one keeps it (macinfer.serve.ollama_models.KeepAlive); an empty
                   prompt or message list only loads (or with 0, unloads) the model

Replies stream as NDJSON (`stream` is true unless false is sent, as Ollama's): one object per
delta (`message.content` / `message.thinking`, `response` / `thinking`; a tool call whole once
parsed), then one with `done: true`, `done_reason` and the token counts and durations. Errors
are Ollama's body, {"error": "..."} (`error_response`). `images` (base64, as Ollama's clients send
them) go to a model that sees before the message's text (macinfer.serve.images).
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from macinfer.chat.events import ContentDelta, Finish, ThinkingDelta, ToolCallEnd
from macinfer.chat.reasoning import thinking_of
from macinfer.chat.request import ChatRequest
from macinfer.core.grammar import StructuredOutput
from macinfer.serve.generation import Generation, Route, held
from macinfer.serve.images import image_part
from macinfer.serve.ollama_models import KeepAlive, keep_alive_seconds, resolve
from macinfer.serve.schemas import APIError, check_known

# Ollama's defaults where a request's options say nothing (its api/types.go). NOTE: not its
# repeat_penalty 1.1: a penalty turns speculation off here, so it applies only when asked for.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
# options -> SamplingParams' fields
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
           "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repetition_penalty",
           "repeat_last_n": "repetition_context_size", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty"}
RUNTIME = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "numa", "num_thread", "use_mmap", "use_mlock",
           "vocab_only", "f16_kv", "logits_all", "embedding_only", "num_keep", "penalize_newline"}
OFF = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}  # samplers not served: accepted only when off
INTEGERS = {"top_k", "seed", "num_predict", "repeat_last_n"}  # the other numeric options are numbers
NAMES = {field: f"options.{option}" for option, field in OPTIONS.items()} | {"response_format": "format"}
DONE_REASONS = {"tool_calls": "stop"}
WHOLE_CONTEXT = 1 << 30  # repeat_last_n -1: the penalties look at every token


def error_response(e: APIError) -> JSONResponse:
    """Ollama's error body: {"error": "..."}."""
    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)


# -- the requests ------------------------------------------------------------------------------
class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    thinking: str | None = None
    images: list[Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None


class ReplyRequest(BaseModel):
    """What /api/chat and /api/generate share; unknown fields are a 400 naming them (unless --lenient)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: float | str | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatBody(ReplyRequest):
    messages: list[OllamaMessage] = []
    tools: list[dict[str, Any]] | None = None


class GenerateBody(ReplyRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[Any] | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None


def check_supported(req: ReplyRequest) -> None:
    refused = [(bool(req.logprobs) or bool(req.top_logprobs), "logprobs",
                "logprobs are not supported on the Ollama API here: use /v1/chat/completions"),
               (bool(getattr(req, "suffix", None)), "suffix", "suffix (fill-in-the-middle) is not supported"),
               (bool(getattr(req, "template", None)), "template", "a custom template is not supported: macinfer "
                "renders the model's own chat template (send raw: true with the prompt formatted)"),
               (bool(getattr(req, "context", None)), "context", "context is not supported: send the conversation "
                "to /api/chat as messages")]
    for bad, param, msg in refused:
        if bad:
            raise APIError(400, msg, param, "unsupported_parameter")
    if getattr(req, "images", None) and getattr(req, "raw", False):
        raise APIError(400, "images need the chat template: send them without raw", "images", "invalid_value")


def sampling(options: dict | None, lenient: bool) -> dict:
    """SamplingParams' fields from `options` (Ollama's defaults for temperature, top_k, top_p)."""
    fields = dict(DEFAULTS)
    for key, value in (options or {}).items():
        if key in OPTIONS:
            fields[OPTIONS[key]] = _checked(key, value)
        elif key in OFF:
            if value != OFF[key]:
                raise APIError(400, f"options.{key} is not supported: leave it out (or {OFF[key]})", f"options.{key}",
                               "unsupported_parameter")
        elif key not in RUNTIME and not lenient:
            raise APIError(400, f"unrecognized option: {key} (start the server with --lenient to ignore unknown "
                                "fields)", f"options.{key}", "unknown_parameter")
    if fields.get("seed") is not None and fields["seed"] < 0:
        fields["seed"] = None  # -1: a fresh seed
    if fields.get("max_tokens") is not None and fields["max_tokens"] < 0:
        fields["max_tokens"] = None  # -1 (no limit), -2 (fill the context): as far as the context allows
    window = fields.get("repetition_context_size")
    if window is not None and window <= 0:
        fields["repetition_context_size"] = WHOLE_CONTEXT if window < 0 else 1
        if window == 0:  # 0: the penalties are off
            fields.update(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    return fields


def _checked(key: str, value):
    """An option's value, if it has its type (SamplingParams checks the ranges)."""
    if key == "stop":
        ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(x, str) for x in value))
        kind = "a string or a list of strings"
    else:
        ok = isinstance(value, int if key in INTEGERS else (int, float)) and not isinstance(value, bool)
        kind = "an integer" if key in INTEGERS else "a number"
    if not ok:
        raise APIError(400, f"options.{key} must be {kind}, got {json.dumps(value)[:40]}", f"options.{key}",
                       "invalid_type")
    return value


def response_format(fmt) -> dict | None:
    if fmt in (None, ""):
        return None
    return {"type": "json_object"} if fmt == "json" else {"type": "json_schema", "json_schema": {"schema": fmt}}


def raw_grammar(fmt) -> StructuredOutput | None:
    """`format` for a raw prompt (no chat layer): the grammar alone."""
    if fmt in (None, ""):
        return None
    so = StructuredOutput(json_object=True) if fmt == "json" else StructuredOutput(json_schema=fmt)
    try:
        so.lark()
    except ValueError as e:
        raise APIError(400, f"format: {e}", "format", "invalid_value") from None
    return so


def thinking_options(think) -> dict:
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"enable_thinking": think}
    return {"enable_thinking": True, "reasoning_effort": think}


def chat_messages(messages: list[OllamaMessage]) -> list[dict]:
    """Ollama's messages in chat's shape: tool_calls get ids (Ollama's have none), a tool result
    the id of the last call to its tool_name."""
    out, ids = [], {}
    for i, m in enumerate(messages):
        message = {"role": m.role, "content": with_images(m.content or "", m.images, f"messages[{i}].images")}
        if m.role == "assistant" and m.thinking:
            message["reasoning_content"] = m.thinking
        if m.role == "assistant" and m.tool_calls:
            message["tool_calls"] = [_call(c, f"call_{i}_{j}", f"messages[{i}].tool_calls[{j}]", ids)
                                     for j, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            message |= {"tool_call_id": ids.get(m.tool_name, "")} | ({"name": m.tool_name} if m.tool_name else {})
        out.append(message)
    return out


def with_images(text: str, images: list | None, where: str) -> str | list[dict]:
    """A message's content with its images before its text (where Ollama puts them), in chat's shape."""
    if not images:
        return text
    parts = []
    for j, b64 in enumerate(images):
        if not isinstance(b64, str) or not b64:
            raise APIError(400, f"{where}[{j}] must be an image's bytes in base64", f"{where}[{j}]", "invalid_value")
        parts.append(image_part(b64 if b64.startswith("data:") else f"data:image/png;base64,{b64}", f"{where}[{j}]"))
    return parts + ([{"type": "text", "text": text}] if text else [])


def _call(call: dict, cid: str, where: str, ids: dict) -> dict:
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise APIError(400, f"{where} must be {{\"function\": {{\"name\": ..., \"arguments\": {{...}}}}}}", where)
    args = f.get("arguments") or {}
    ids[f["name"]] = cid
    return {"id": cid, "type": "function",
            "function": {"name": f["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    for i, t in enumerate(tools or []):
        if t.get("type", "function") != "function":
            raise APIError(400, f"tools[{i}].type {t.get('type')!r} is not supported: only function tools",
                           f"tools[{i}].type")
    return tools or None


# -- the replies --------------------------------------------------------------------------------
def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class Reply:
    """One reply's NDJSON objects, for /api/chat (`message`) or /api/generate (`response`)."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.text, self.thought, self.calls = [], [], []
        self.finish: Finish | None = None

    def add(self, event) -> dict | None:
        """The streamed object for one event (None: nothing to send)."""
        if isinstance(event, ContentDelta):
            self.text.append(event.text)
            return self.piece(content=event.text)
        if isinstance(event, ThinkingDelta):
            self.thought.append(event.text)
            return self.piece(thinking=event.text)
        if isinstance(event, ToolCallEnd):
            call = {"function": {"index": event.index, "name": event.name, "arguments": _arguments(event.arguments)}}
            self.calls.append(call)
            return self.piece(tool_calls=[call]) if self.chat else None
        if isinstance(event, Finish):
            self.finish = event
        return None

    def piece(self, content: str = "", thinking: str | None = None, tool_calls: list | None = None,
              done: bool = False) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": content}
            message |= ({"thinking": thinking} if thinking else {}) | ({"tool_calls": tool_calls} if tool_calls else {})
            body = {"message": message}
        else:
            body = {"response": content} | ({"thinking": thinking} if thinking else {})
        return {"model": self.model, "created_at": now(), **body, "done": done}

    def done(self, gen: Generation, whole: bool) -> dict:
        """The last object: with `whole`, the reply's text too (a non-streamed reply is this object alone)."""
        thought = "".join(self.thought) if whole else None
        body = self.piece("".join(self.text) if whole else "", thought, self.calls if whole else None, done=True)
        out, m = gen.output, gen.output.metrics
        first = m.first_token_time or m.finish_time
        body |= {"done_reason": DONE_REASONS.get(self.finish.reason, self.finish.reason),
                 "total_duration": _ns(m.finish_time - m.arrival_time), "load_duration": 0,
                 "prompt_eval_count": len(out.prompt_token_ids), "prompt_eval_duration": _ns(first - m.arrival_time),
                 "eval_count": len(out.token_ids), "eval_duration": _ns(m.finish_time - first)}
        if not self.chat:
            body["context"] = list(out.prompt_token_ids) + list(out.token_ids)
        return body


def _arguments(text: str):
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return text


def _ns(seconds: float | None) -> int:
    return int(max(0.0, seconds or 0.0) * 1e9)


class OllamaReplies:
    """/api/chat and /api/generate: one request through a Generation, then keep_alive."""

    def __init__(self, server, keep_alive: KeepAlive):
        self.server, self.keep_alive = server, keep_alive

    async def chat(self, req: ChatBody, http: Request):
        if not req.messages:
            return await self._load_only(req, chat=True)
        chat = ChatRequest(chat_messages(req.messages), tools=chat_tools(req.tools),
                           response_format=response_format(req.format), **thinking_options(req.think))
        return await self._reply(req, http, Route("ollama", "api/chat"), chat=chat)

    async def generate(self, req: GenerateBody, http: Request):
        if not req.prompt:
            return await self._load_only(req, chat=False)
        if req.raw:
            return await self._reply(req, http, Route("ollama", "api/generate"), prompt=req.prompt,
                                     structured=raw_grammar(req.format))
        messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
            [{"role": "user", "content": with_images(req.prompt, req.images, "images")}]
        chat = ChatRequest(messages, response_format=response_format(req.format), **thinking_options(req.think))
        return await self._reply(req, http, Route("ollama", "api/generate"), chat=chat)

    async def _reply(self, req: ReplyRequest, http: Request, route: Route, **what):
        check_known(req, self.server.lenient)
        check_supported(req)
        seconds = keep_alive_seconds(req.keep_alive)
        name = await resolve(self.server.pool, req.model)
        gen = await Generation.start(self.server, http, name, route, names=NAMES,
                                     sampling=sampling(req.options, self.server.lenient),
                                     check=lambda m: _check_think(m, req.think), **what)
        if gen is None:
            return PlainTextResponse("", status_code=499)
        # NOTE: a pending keep_alive unload of the model (even one waiting for another model's load, or
        # draining it for this reply) gives way to this reply's keep_alive, set when it ends.
        self.keep_alive.cancel(name)
        reply = Reply(req.model, chat=route.endpoint == "api/chat")
        if req.stream:
            return StreamingResponse(self._ndjson(gen, reply, seconds), media_type="application/x-ndjson")
        async for event in gen.events():
            reply.add(event)
        if gen.output is None:
            return PlainTextResponse("", status_code=499)
        self.keep_alive.set(gen.model, seconds)
        return reply.done(gen, whole=True)

    async def _ndjson(self, gen: Generation, reply: Reply, seconds):
        try:
            async for event in gen.events(watch_disconnect=False):
                body = reply.add(event)
                if body is not None:
                    yield json.dumps(body, ensure_ascii=False) + "\n"
        except APIError as e:  # the engine stopped mid-reply: an error line, as Ollama ends a stream it cannot finish
            yield json.dumps({"error": e.message}, ensure_ascii=False) + "\n"
            return
        yield json.dumps(reply.done(gen, whole=False), ensure_ascii=False) + "\n"
        self.keep_alive.set(gen.model, seconds)

    async def _load_only(self, req: ReplyRequest, chat: bool) -> dict:
        """An empty prompt (or message list): load the model, or with keep_alive 0 unload it."""
        check_known(req, self.server.lenient)
        seconds = keep_alive_seconds(req.keep_alive)
        m = await self.server.pool.lookup(await resolve(self.server.pool, req.model))
        if seconds != 0:  # NOTE: keep_alive 0 (`ollama stop`) loads nothing, so it evicts no other model
            async with held(self.server.pool, m.name):
                pass
        reason = "unload" if seconds == 0 and not m.pinned else "load"  # the default model stays loaded
        self.keep_alive.set(m, seconds)
        body = Reply(req.model, chat).piece(done=True)
        return body | {"done_reason": reason}


def _check_think(m, think) -> None:
    """Ollama's refusal: `think` for a model that does not think."""
    if think not in (None, False) and thinking_of(m.llm.tokenizer) is None:
        raise APIError(400, f"'{m.name}' does not support thinking: leave out think", "think", "invalid_value")


def add_routes(app: FastAPI, server, keep_alive: KeepAlive) -> None:
    """POST /api/chat and /api/generate."""
    replies = OllamaReplies(server, keep_alive)

    @app.post("/api/chat")
    async def chat(body: ChatBody, request: Request):
        return await replies.chat(body, request)

    @app.post("/api/generate")
    async def generate(body: GenerateBody, request: Request):
        return await replies.generate(body, request)
