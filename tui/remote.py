"""A running OpenAI-compatible server as the chat's backend (`macinfer chat --url`).

    RemoteBackend(url="http://127.0.0.1:8000", api_key=None)   # built by the engine process

It speaks ChatBackend's vocabulary, so macinfer.tui.runner drives it like a local engine and every
figure takes the same path to the UI. A request is a streamed chat completion (the official
openai client) read on a thread of its own into one queue; `step()` hands out what has
arrived, one chunk per step, and returns empty-handed after POLL seconds so the runner can take
an Abort meanwhile. Timings are the client's: TTFT and decode tok/s include the network. A
chunk counts as one token while streaming; the usage the server sends last (stream_options
include_usage) gives the exact counts of the finished reply.
"""

from __future__ import annotations

import base64
import mimetypes
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from macinfer.chat.events import ContentDelta, Finish, ThinkingDelta, Usage
from macinfer.core.metrics import RequestMetrics
from macinfer.core.outputs import RequestOutput, StreamDelta
from macinfer.errors import MacinferError
from macinfer.tui.messages import ModelCard

if TYPE_CHECKING:
    from macinfer.core.sampling_params import SamplingParams

POLL = 0.05  # seconds step() waits for a chunk: how long an Abort may wait behind it
TIMEOUT = 600.0  # seconds a read may take: a long prompt's prefill on a big model
CONNECT_TIMEOUT = 10.0  # seconds to list the server's models


def server_root(url: str) -> str:
    """'http://h:8000/v1/' -> 'http://h:8000': where /v1, /metrics and /health live.

    Raises:
        MacinferError: `url` is not an http(s)://HOST[:PORT] address.
    """
    root = url.strip().rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    u = urlparse(root)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise MacinferError(f"--url wants a server's address like http://127.0.0.1:8000, got '{url}'")
    return root


def error_line(e: Exception, root: str) -> str:
    """One line for what the openai client raised talking to `root`."""
    import openai

    if isinstance(e, openai.APIConnectionError):  # a timeout included
        cause = e.__cause__ or e.__context__
        return f"cannot reach {root}: {cause or e} (is the server running?)"
    if isinstance(e, openai.AuthenticationError):
        return f"{root} refused the API key: pass the server's key with --api-key"
    if isinstance(e, openai.APIStatusError):
        body = e.body if isinstance(e.body, dict) else {}  # the client unwraps OpenAI's {"error": {...}}
        message = body.get("message") if isinstance(body.get("message"), str) else None
        return f"{root} answered {e.status_code}: {(message or e.message).splitlines()[0]}"
    return f"{root}: {type(e).__name__}: {e}"


class ChatPrompt(list):
    """What RemoteBackend.encode hands the runner: no token ids (the server tokenises, and the
    usage at the end says how many), the conversation to send."""

    def __init__(self, messages: list[dict]):
        super().__init__()
        self.messages = messages


@dataclass
class _Stream:
    """One streamed request, as its reader thread and the runner's thread share it."""

    request_id: str
    arrival: float
    response: Any = None  # the openai Stream, once the server answered
    cancelled: bool = False
    first_token: float | None = None
    chunks: int = 0
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Any = None


class RemoteBackend:
    """A model on an OpenAI-compatible server: a streamed chat completion per request.

    Args:
        spec: the model to ask for (None: the first one /v1/models lists).
        url: the server, http://HOST:PORT (a trailing /v1 is fine).
        api_key: sent as `Authorization: Bearer`; None for a server without one.
    """

    peak = None  # no bandwidth figure: the weights are read on another machine
    prefix_cache = None  # the server's engine options are its own (n/a here)
    speculation = None

    def __init__(self, spec: str | None = None, *, url: str, api_key: str | None = None):
        self.spec = spec
        self.root = server_root(url)
        self.api_key = api_key
        self.client = None
        self.info = None  # .name: the model, once loaded
        self.context_length = 0
        self.streams: dict[str, _Stream] = {}
        self.events: queue.Queue = queue.Queue()  # (request id, kind, time, value) from the readers

    # -- loading ----------------------------------------------------------------------
    def load(self, progress) -> ModelCard:
        """Connect: the model to chat with, from the server's /v1/models."""
        progress(f"connecting to {self.root}", 0, None)
        self.client = connect(self.root, self.api_key)
        name, self.context_length = find_model(self.client, self.root, self.spec)
        self.info = SimpleNamespace(name=name)
        return self.card()

    def card(self) -> ModelCard:
        return ModelCard(name=self.info.name, weight_bytes=0, num_params=0, quantization="remote",
                         context_length=self.context_length, bytes_per_decode_step=0, kv_bytes_per_token=0,
                         peak_gbps=None, peak_source=None, prefix_cache=None, speculation=None, spec=self.spec,
                         server=self.root)

    def close(self) -> None:
        for rid in list(self.streams):
            self.abort_request(rid)
        if self.client is not None:
            self.client.close()

    # -- requests ---------------------------------------------------------------------
    def encode(self, messages: list[dict]) -> ChatPrompt:
        """The conversation as OpenAI messages: a turn's attached images (paths) go as data-URL image parts."""
        return ChatPrompt([_with_image_parts(m) for m in messages])

    def prepare(self, messages: list[dict], params: SamplingParams, think: bool | None = None):
        """(the conversation to send, sampling, its parser): the server splits the thought itself
        (`reasoning_content` deltas), RemoteReply only sorts the pieces."""
        prompt = self.encode(messages)
        prompt.think = think
        return prompt, params, RemoteReply()

    def add_request(self, prompt: ChatPrompt, params: SamplingParams, request_id: str) -> str:
        """Start streaming the reply on a thread of its own (the server answers after its prefill)."""
        s = self.streams[request_id] = _Stream(request_id, time.perf_counter())
        # A turn's kept thought stays here: other servers refuse message fields they do not know.
        messages = [{k: v for k, v in m.items() if k != "reasoning"} for m in prompt.messages]
        args = dict(model=self.info.name, messages=messages, max_tokens=params.max_tokens,
                    temperature=params.temperature, stream=True, stream_options={"include_usage": True})
        if params.seed is not None:
            args["seed"] = params.seed
        if getattr(prompt, "think", None) is not None:
            args["extra_body"] = {"chat_template_kwargs": {"enable_thinking": prompt.think}}
        threading.Thread(target=self._read, args=(s, args), name=f"stream-{request_id}", daemon=True).start()
        return request_id

    def _read(self, s: _Stream, args: dict) -> None:
        """The reader thread: the stream's chunks into `events`, then ("end", ...) or ("error", ...)."""
        def put(kind: str, value=None) -> None:
            self.events.put((s.request_id, kind, time.perf_counter(), value))

        try:
            s.response = self.client.chat.completions.create(**args)
            if s.cancelled:  # aborted while the server was prefilling
                s.response.close()
                return
            for chunk in s.response:
                if chunk.choices:
                    choice = chunk.choices[0]
                    thought = getattr(choice.delta, "reasoning_content", None) if choice.delta is not None else None
                    if thought:
                        put("thought", thought)
                    if choice.delta is not None and choice.delta.content:
                        put("text", choice.delta.content)
                    s.finish_reason = choice.finish_reason or s.finish_reason
                if getattr(chunk, "usage", None):
                    s.usage = chunk.usage
            put("end")
        except Exception as e:  # closed by abort_request, or the server failed
            if not s.cancelled:
                put("error", error_line(e, self.root))

    def step(self) -> list[StreamDelta]:
        """The next chunk that arrived (waiting up to POLL seconds): a delta, or none.

        Raises:
            MacinferError: the server refused the request or the stream broke (one line).
        """
        try:
            rid, kind, t, value = self.events.get(timeout=POLL)
        except queue.Empty:
            return []
        s = self.streams.get(rid)
        if s is None:  # aborted: what was still queued
            return []
        if kind in ("text", "thought"):
            s.first_token = s.first_token or t
            s.chunks += 1
            delta = StreamDelta(rid, value, [0])  # ids stay on the server: one per chunk
            if kind == "thought":
                delta.thinking = True  # read by RemoteReply
            else:
                s.text.append(value)
            return [delta]
        del self.streams[rid]
        if kind == "error":
            raise MacinferError(value)
        return [StreamDelta(rid, "", [], s.finish_reason or "stop", self._output(s, t))]

    @staticmethod
    def _output(s: _Stream, end: float) -> RequestOutput:
        """The finished reply: client-side times, the server's token counts (if it sent usage)."""
        u = s.usage
        cached = getattr(getattr(u, "prompt_tokens_details", None), "cached_tokens", None) or 0
        m = RequestMetrics(arrival_time=s.arrival, first_token_time=s.first_token or end, finish_time=end,
                           prompt_tokens=u.prompt_tokens if u else 0, cached_tokens=cached,
                           generation_tokens=u.completion_tokens if u else s.chunks)
        out = RequestOutput(s.request_id, [], [0] * m.generation_tokens, "".join(s.text), s.finish_reason or "stop", m)
        details = getattr(u, "completion_tokens_details", None)
        out.reasoning_tokens = getattr(details, "reasoning_tokens", None)  # the server's count (RemoteReply)
        return out

    def abort_request(self, request_id: str) -> None:
        """Close the stream: the server sees the client leave and frees the request."""
        s = self.streams.pop(request_id, None)
        if s is None:
            return
        s.cancelled = True
        if s.response is not None:  # else the reader closes it once the server answers
            s.response.close()

    def has_unfinished(self) -> bool:
        return bool(self.streams)

    def request_metrics(self, request_id: str) -> None:
        return None  # the engine's metrics stay on the server

    # -- what the engine can tell: the server's /metrics, polled by the UI (macinfer.tui.widgets.server) --
    def kv_stats(self) -> None:
        return None

    def peak_memory(self) -> None:
        return None

    def set_option(self, name: str, on: bool) -> str:
        raise MacinferError("the server's engine options are set where it runs: restart `macinfer serve` to change them")


class RemoteReply:
    """The runner's parser for a server's reply: its deltas are thought or answer as the server
    split them (macinfer.chat.output.OutputParser's events, without parsing anything)."""

    def __init__(self):
        self.reasoning_tokens = 0

    def feed(self, delta) -> list:
        events = []
        if getattr(delta, "thinking", False):
            self.reasoning_tokens += len(delta.token_ids)
            events.append(ThinkingDelta(delta.text))
        elif delta.text:
            events.append(ContentDelta(delta.text))
        if delta.finish_reason is not None:
            m = delta.output.metrics if delta.output is not None else None
            reasoning = getattr(delta.output, "reasoning_tokens", None) if delta.output is not None else None
            self.reasoning_tokens = reasoning if reasoning is not None else self.reasoning_tokens
            events.append(Finish(delta.finish_reason, Usage(m.prompt_tokens if m else 0,
                                                            m.generation_tokens if m else 0, self.reasoning_tokens)))
        return events


def connect(root: str, api_key: str | None):
    """An openai client for the server at `root` (no retries: a failure is shown at once)."""
    from openai import OpenAI

    return OpenAI(base_url=root + "/v1", api_key=api_key or "none", max_retries=0, timeout=TIMEOUT)


def check_server(url: str, api_key: str | None, spec: str | None) -> None:
    """Before the UI starts: the server answers and serves `spec`.

    Raises:
        MacinferError: one line (a malformed URL, nothing listening, the key refused, no such model).
    """
    root = server_root(url)
    with connect(root, api_key) as client:
        find_model(client, root, spec)


def find_model(client, root: str, spec: str | None) -> tuple[str, int]:
    """(model name, context length or 0) on the server: `spec`, or the first model it lists.

    Raises:
        MacinferError: the server cannot be reached, refuses the key, or does not serve `spec`.
    """
    import openai

    try:
        models = client.with_options(timeout=CONNECT_TIMEOUT).models.list().data
    except (openai.APIConnectionError, openai.AuthenticationError) as e:
        raise MacinferError(error_line(e, root)) from None
    except openai.APIError:  # reachable, but no /v1/models (mlx_lm.server without a HF cache)
        models = []
    names = [m.id for m in models]
    if spec is not None and names and spec not in names:
        raise MacinferError(f"{root} does not serve {spec}: it serves {', '.join(names)}")
    name = spec or (names[0] if names else "default_model")  # mlx_lm.server's name for its model
    ctx = next((getattr(m, "max_model_len", None) for m in models if m.id == name), None)
    return name, int(ctx or 0)


def _with_image_parts(message: dict) -> dict:
    """An OpenAI message from a session turn: its `images` (paths) as image_url parts before its text."""
    images = message.get("images")
    if not images:
        return {k: v for k, v in message.items() if k != "images"}
    parts = []
    for p in images:
        try:
            data = Path(p).read_bytes()
        except OSError as e:
            raise MacinferError(f"cannot read the attached image {p}: {e.strerror or type(e).__name__}") from None
        kind = mimetypes.guess_type(p)[0] or "image/png"
        parts.append({"type": "image_url", "image_url": {"url": f"data:{kind};base64,{base64.b64encode(data).decode()}"}})
    return {"role": message["role"], "content": parts + [{"type": "text", "text": message["content"]}]}
