"""The engine loop: owns the backend, takes commands from a pipe, posts Messages.

    UI process ──send(Load | Generate | Abort | SetOption | Call)──> pipe
                                                                      │
    engine process:  loop { take a command if one waits; if requests run: backend.step() }
                                                                      │
    chat screen <──(reader thread)── pipe <──post(LoadProgress, ReplyText, StatsUpdate, ...)

It runs on the main thread of the engine process (macinfer.tui.engine_process starts it), so
only that thread touches the backend and MLX, and nothing the UI does (layout,
Markdown, garbage collection) holds its GIL. It never waits on the UI: `post` only
writes to a pipe. Every write wakes the UI's reader thread, which on a busy machine
costs the engine a context switch in the middle of its loop, so writes are few: text
goes at most every TEXT_INTERVAL seconds, the live figures only along with it and at
most every STATS_INTERVAL, and what one step has to say goes as one list (the reader
posts its Messages in order). The reply widget then batches the text it shows
(macinfer.tui.widgets.transcript.Reply).
"""

from __future__ import annotations

import selectors
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from macinfer.errors import MacinferError
from macinfer.core.metrics import RequestMetrics
from macinfer.core.outputs import RequestOutput

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from macinfer.core.sampling_params import SamplingParams
    from macinfer.tui.backend import ChatBackend
from macinfer.chat.events import ContentDelta, Finish, ThinkingDelta
from macinfer.tui.messages import (EngineNotice, LoadFailed, LoadProgress, ModelLoaded, ReplyFailed,
                          ReplyFinished, ReplyText, ReplyThought, Stats, StatsUpdate)

TEXT_INTERVAL = 0.08
STATS_INTERVAL = 1 / 4
SPARK_STEPS = 60


# -- commands (UI -> engine process) ------------------------------------------------------
@dataclass
class Load:
    spec: str | None


@dataclass
class Generate:
    request_id: str
    messages: list[dict]
    params: SamplingParams
    think: bool | None = None  # enable_thinking for the template (None: its default)


@dataclass
class Abort:
    request_id: str


@dataclass
class SetOption:
    name: str  # "prefix_cache" | "speculation"
    on: bool


@dataclass
class Call:
    """Run fn(backend, *args) between steps and send back Returned(call_id, ...): how tests
    and tools look at the engine, which lives in another process (fn must pickle)."""

    call_id: int
    fn: Callable
    args: tuple = ()


@dataclass
class Returned:
    """A Call's result, or its error in one line (then value is None)."""

    call_id: int
    value: Any = None
    error: str | None = None


@dataclass
class _Live:
    """Clock and counters of the request in flight."""

    request_id: str
    prompt_tokens: int
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    steps: int = 0  # decode steps (target forwards) that gave it tokens: fewer than tokens with drafts
    prev_step: float | None = None  # when the step before the latest one ended
    step_tps: deque = field(default_factory=lambda: deque(maxlen=SPARK_STEPS))
    metrics: RequestMetrics | None = None  # the engine's, taken at the first token (prefix hit known)
    text: list[str] = field(default_factory=list)
    text_posted: float = 0.0
    stats_posted: float = 0.0
    parser: Any = None  # the reply's OutputParser (macinfer.chat.output); None: every piece is answer
    thought: list[str] = field(default_factory=list)  # thought text not posted yet
    thought_tokens: int = 0
    thought_start: float | None = None
    thought_end: float | None = None  # the answer began (or the reply ended) after a thought
    thought_posted_done: bool = False


def one_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


class EngineRunner:
    """Runs the backend on the calling thread until the UI closes its end of the command pipe.

    Args:
        make_backend: builds an unloaded ChatBackend for a MODEL spec.
        post: delivers a Message (or a Returned) to the UI.
    """

    def __init__(self, make_backend: Callable[[str | None], ChatBackend], post: Callable[[object], object]):
        self.make_backend = make_backend
        self.post = post
        self.backend: ChatBackend | None = None
        self.live: dict[str, _Live] = {}
        self.last_stats = Stats()

    def run(self, commands: Connection) -> None:
        """Take commands from `commands` (one between two steps) until the UI closes it."""
        # One selector for the whole loop: Connection.poll builds and registers a new one
        # on every call, which between the steps of a fast model adds up.
        waiting = selectors.DefaultSelector()
        waiting.register(commands, selectors.EVENT_READ)
        try:
            while True:
                busy = self.backend is not None and self.backend.has_unfinished()
                if waiting.select(0 if busy else None):  # idle: sleep until a command (or EOF) comes
                    self._handle(commands.recv())  # EOFError: the UI is done, or gone
                elif busy:
                    self._step()
        except EOFError:
            pass
        finally:
            waiting.close()
            if self.backend is not None:
                self.backend.close()
                self.backend = None

    # -- commands -------------------------------------------------------------------
    def _handle(self, command) -> None:
        if isinstance(command, Load):
            self._load(command.spec)
        elif isinstance(command, Generate):
            self._generate(command)
        elif isinstance(command, Abort):
            self._abort(command.request_id)
        elif isinstance(command, SetOption):
            self._set_option(command)
        elif isinstance(command, Call):
            self._call(command)

    def _load(self, spec: str | None) -> None:
        """Load `spec`; the previous model stays loaded if this one fails."""
        for rid in list(self.live):
            self._abort(rid)
        old = self.backend
        current = old.info.name if old is not None and old.info is not None else None
        try:
            backend = self.make_backend(spec)
            card = backend.load(lambda what, done, total: self.post(LoadProgress(what, done, total)))
        except (MacinferError, ValueError) as e:
            self.post(LoadFailed(spec, one_line(e), current))
            return
        except Exception as e:  # a half-written model dir raises anything; keep the UI alive
            self.post(LoadFailed(spec, f"{type(e).__name__}: {one_line(e)}", current))
            return
        if old is not None:
            old.close()
        self.backend = backend
        self.last_stats = Stats(cached_tokens=None, kv=backend.kv_stats(), peak_memory=backend.peak_memory())
        self.post(ModelLoaded(card, self.last_stats))

    def _generate(self, cmd: Generate) -> None:
        if self.backend is None:
            self.post(ReplyFailed(cmd.request_id, "no model is loaded"))
            return
        try:
            ids, params, parser = self.backend.prepare(cmd.messages, cmd.params, cmd.think)
            self.backend.add_request(ids, params, request_id=cmd.request_id)
        except (MacinferError, ValueError) as e:
            self.post(ReplyFailed(cmd.request_id, one_line(e)))
            return
        live = self.live[cmd.request_id] = _Live(cmd.request_id, len(ids), time.perf_counter(), parser=parser)
        self.post(StatsUpdate(self._stats(live, live.arrival)))  # prompt size, before a slow prefill

    def _abort(self, request_id: str) -> None:
        live = self.live.pop(request_id, None)
        if self.backend is not None:
            self.backend.abort_request(request_id)
        if live is not None:
            now = time.perf_counter()
            self.last_stats = stats = self._stats(live, now)
            self.post([*self._take_text(live, now, end=True), ReplyFinished(request_id, "abort", stats)])

    def _set_option(self, cmd: SetOption) -> None:
        if self.backend is None:
            self.post(EngineNotice("no model is loaded", error=True))
            return
        try:
            self.post(EngineNotice(self.backend.set_option(cmd.name, cmd.on)))
            self.post(ModelLoaded(self.backend.card(), self.last_stats))
        except (MacinferError, ValueError) as e:
            self.post(EngineNotice(one_line(e), error=True))

    def _call(self, cmd: Call) -> None:
        try:
            self.post(Returned(cmd.call_id, cmd.fn(self.backend, *cmd.args)))
        except Exception as e:  # fn failed, or its result does not pickle
            self.post(Returned(cmd.call_id, error=f"{type(e).__name__}: {one_line(e)}"))

    # -- stepping -------------------------------------------------------------------
    def _step(self) -> None:
        try:
            deltas = self.backend.step()
        except Exception as e:  # a failing step must end the reply, not hang the UI
            said = isinstance(e, MacinferError)  # a user's error (a server's refusal): its line is enough
            for rid in list(self.live):
                self.live.pop(rid)
                self.backend.abort_request(rid)
                self.post(ReplyFailed(rid, one_line(e) if said else f"{type(e).__name__}: {one_line(e)}"))
            if not said:
                traceback.print_exc()
            return
        now = time.perf_counter()
        out: list = []  # this step's Messages, posted as one batch (one pipe write)
        for delta in deltas:
            live = self.live.get(delta.request_id)
            if live is None:
                continue
            self._count(live, delta, now)
            if delta.finish_reason is not None:
                del self.live[live.request_id]
                out += self._take_text(live, now, end=True)
                self.last_stats = stats = self._stats(live, now, delta.output)
                out.append(ReplyFinished(live.request_id, delta.finish_reason, stats, delta.output))
            elif now - live.text_posted >= TEXT_INTERVAL:  # text, and the figures with it when due
                out += self._take_text(live, now)
                if now - live.stats_posted >= STATS_INTERVAL:
                    live.stats_posted = now
                    out.append(StatsUpdate(self._stats(live, now)))
        if out:
            self.post(out if len(out) > 1 else out[0])

    def _count(self, live: _Live, delta, now: float) -> None:
        """Add a delta's tokens and text to the request's counters (`now`: when its step ended)."""
        if delta.token_ids:
            n = len(delta.token_ids)
            if live.first_token is None:
                live.first_token = now
                live.metrics = self.backend.request_metrics(live.request_id)
            elif now > live.last_token:  # a new step: one step's deltas (its accepted drafts) share `now`
                live.steps += 1
                live.prev_step = live.last_token
                live.step_tps.append(n / (now - live.prev_step))
            elif live.steps:  # more tokens of the same step
                live.step_tps[-1] += n / (now - live.prev_step)
            live.last_token = now
            live.tokens += n
        events = live.parser.feed(delta) if live.parser is not None else \
            [ContentDelta(delta.text)] if delta.text else []
        for e in events:
            if isinstance(e, ThinkingDelta):
                live.thought_start = live.thought_start or now
                live.thought.append(e.text)
            elif isinstance(e, ContentDelta):
                if live.thought_start is not None and live.thought_end is None:
                    live.thought_end = now
                live.text.append(e.text)
            elif isinstance(e, Finish):
                live.thought_tokens = e.usage.reasoning_tokens
        if live.parser is not None and live.thought_start is not None and live.thought_end is None:
            live.thought_tokens = live.parser.reasoning_tokens

    def _take_text(self, live: _Live, now: float, end: bool = False) -> list:
        """The thought and answer text not posted yet, as messages (none if there is none).

        end: the reply is over, so a thought still open is done too.
        """
        live.text_posted = now
        out = []
        if live.thought_start is not None and (live.thought or not live.thought_posted_done):
            done = live.thought_end is not None or end
            if live.thought or done:
                seconds = (live.thought_end or now) - live.thought_start
                out.append(ReplyThought(live.request_id, "".join(live.thought), live.thought_tokens, seconds, done))
                live.thought.clear()
                live.thought_posted_done = done
        if live.text:
            out.append(ReplyText(live.request_id, "".join(live.text)))
            live.text.clear()
        return out

    def _stats(self, live: _Live, now: float, output: RequestOutput | None = None) -> Stats:
        """Figures for the metrics panel; a finished output's own metrics win (same as `macinfer run`)."""
        b = self.backend
        ttft = (live.first_token - live.arrival) if live.first_token is not None else None  # a clock may read 0
        m = live.metrics
        prompt_cached = m is not None and m.prompt_cached
        computed = live.prompt_tokens - (m.cached_tokens if m is not None else 0)  # as RequestMetrics.prefill_tps
        prefill = computed / ttft if ttft and not prompt_cached else None
        decode = forwards = None  # tokens and target forwards per second of decode
        if live.first_token is not None and live.last_token is not None and live.tokens > 1 \
                and live.last_token > live.first_token:
            decode = (live.tokens - 1) / (live.last_token - live.first_token)
            forwards = live.steps / (live.last_token - live.first_token)
        cached = acceptance = None  # known when the request finishes
        prompt, generated, kv_tokens = live.prompt_tokens, live.tokens, live.prompt_tokens + live.tokens / 2
        if output is not None:
            m = output.metrics
            ttft, prefill, decode, forwards = m.ttft, m.prefill_tps, m.decode_tps, m.decode_forward_rate
            prompt_cached = m.prompt_cached
            prompt, generated, kv_tokens = m.prompt_tokens, m.generation_tokens, m.mean_kv_tokens
            cached = m.cached_tokens if b.prefix_cache else None
            acceptance = m.acceptance_rate if b.speculation else None
        bandwidth = None
        if forwards and b.peak:
            from macinfer.perf.bandwidth import bytes_per_step, utilisation

            bandwidth = utilisation(bytes_per_step(b.info, kv_tokens), forwards, b.peak)
        return Stats(
            ttft=ttft, prefill_tps=prefill, prompt_cached=prompt_cached, decode_tps=decode,
            step_tps=tuple(live.step_tps), bandwidth=bandwidth, prompt_tokens=prompt, generated_tokens=generated,
            cached_tokens=cached, acceptance=acceptance, kv=b.kv_stats(), peak_memory=b.peak_memory(),
        )
