"""What the engine tells the UI: Message dataclasses, nothing else.

The engine process (macinfer.tui.runner, started by macinfer.tui.engine_process) sends these to the
UI process, whose reader thread posts them to the chat screen; the UI never calls
the engine. They cross a pipe as their fields (EngineMessage) and are built anew on
arrival, so everything in them pickles. Bursty ones (load progress, live stats) define `can_replace`
so Textual drops a stale one when a newer one is already queued; the streaming
ones (text, live stats) do not bubble, so the app does not dispatch them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from textual.message import Message

from macinfer.core.outputs import RequestOutput


@dataclass
class KVStats:
    """The engine's KV cache right now (None fields where the engine cannot say)."""

    used_blocks: int
    free_blocks: int
    tokens_held: int
    block_size: int


@dataclass
class ModelCard:
    """The loaded model, as the metrics panel shows it."""

    name: str
    weight_bytes: int
    num_params: int
    quantization: str
    context_length: int
    bytes_per_decode_step: int
    kv_bytes_per_token: int
    peak_gbps: float | None
    peak_source: str | None
    prefix_cache: bool | None  # None: this engine has no prefix cache
    speculation: bool | None  # None: this engine cannot speculate
    attention: str = "reference"  # the engine's attention backend: "metal" or "reference"
    spec: str | None = None  # MODEL as it was asked for (None: the embedded default): what /save records
    server: str | None = None  # the server it runs on (`chat --url`); None: loaded here
    drafter: str | None = None  # the drafter while speculation is on (what `--draft auto` picked)


@dataclass
class Stats:
    """Figures of the reply in progress (or the last one), all measured, None if unknown."""

    ttft: float | None = None
    prefill_tps: float | None = None
    prompt_cached: bool = False  # the prefix cache held the whole prompt: no prefill rate
    decode_tps: float | None = None
    step_tps: tuple[float, ...] = ()  # recent per-step decode rates, oldest first
    bandwidth: float | None = None  # fraction of peak
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int | None = None  # None: no prefix cache in this engine
    acceptance: float | None = None  # None: speculation off or unavailable
    kv: KVStats | None = None
    peak_memory: int | None = None


class EngineMessage(Message):
    """A Message that crosses from the engine process: pickled as its dataclass fields.

    NOTE: unpickling calls the constructor again, in the UI's reader thread, so the
    Message's own bookkeeping (sender, timestamp) is the UI process's, as if it had
    been made there; a pickled copy of the engine process's would not be.
    """

    def __reduce__(self):
        return type(self), tuple(getattr(self, f.name) for f in fields(self))


@dataclass(eq=False)
class LoadProgress(EngineMessage):
    """Model loading / first-time conversion: done of total (total None: indeterminate)."""

    what: str
    done: int = 0
    total: int | None = None

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, LoadProgress)


@dataclass(eq=False)
class ModelLoaded(EngineMessage):
    card: ModelCard
    stats: Stats = field(default_factory=Stats)


@dataclass(eq=False)
class LoadFailed(EngineMessage):
    spec: str | None
    error: str
    current: str | None = None  # the model still loaded, if any


@dataclass(eq=False)
class ReplyText(EngineMessage, bubble=False):
    """New text of the reply in progress (for the chat screen only: it does not bubble to the app)."""

    request_id: str
    text: str


@dataclass(eq=False)
class ReplyThought(EngineMessage, bubble=False):
    """New text of the reply's thought (a model that thinks first), with the thought's figures so far.

    done: the thought is over (the answer or the end came): `seconds` is how long it took.
    """

    request_id: str
    text: str
    tokens: int
    seconds: float
    done: bool = False


@dataclass(eq=False)
class StatsUpdate(EngineMessage, bubble=False):
    """Live figures while a reply streams; a newer one supersedes a queued one (no bubbling)."""

    stats: Stats

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, StatsUpdate)


@dataclass(eq=False)
class ReplyFinished(EngineMessage):
    """The reply ended: finish_reason is "stop", "length" or "abort"."""

    request_id: str
    finish_reason: str
    stats: Stats
    output: RequestOutput | None = None


@dataclass(eq=False)
class ReplyFailed(EngineMessage):
    """The request could not run (e.g. the conversation outgrew the context)."""

    request_id: str | None
    error: str


@dataclass(eq=False)
class EngineNotice(EngineMessage):
    """A one-line answer from the engine to a command (e.g. a toggle)."""

    text: str
    error: bool = False


@dataclass(eq=False)
class EngineStopped(EngineMessage):
    """The engine process ended without being asked to: `error` says how, in one line."""

    error: str


@dataclass(eq=False)
class EngineOutput(EngineMessage):
    """Text the engine process printed (a warning, a traceback): for the app's log, not the screen."""

    text: str
