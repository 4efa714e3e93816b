"""The engine loop: one background thread steps the engine; asyncio callers stream from it.

    HTTP handler (event loop)              engine thread
    ───────────────────────────            ───────────────────────────────────────
    generate(ids, params) ──inbox──────▶   add_request / abort_request (drained
       ▲                                   before every step)
       │ asyncio.Queue per request  ◀───   step() -> deltas, each handed to its
       │ (call_soon_threadsafe)            request's queue on the caller's loop
    client disconnects ──abort─inbox──▶    abort_request: its blocks are freed

Design choices:
- NOTE: only the engine thread touches the engine (MLX state, block pool, scheduler).
  Other threads talk to it through a thread-safe inbox, so the engine needs no locks.
- Every request of every client goes through the same `step()`, so concurrent
  clients are batched by the engine's scheduler (continuous batching).
- A caller that stops iterating (client disconnect, cancellation) aborts its request.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import time
import uuid
import weakref
from typing import AsyncIterator, Callable

from macinfer.core.outputs import StreamDelta
from macinfer.core.sampling import SamplingParams
from macinfer.engine.protocol import Engine

log = logging.getLogger("macinfer.serve.server")


# engine -> the AsyncEngine whose thread steps it (at most one may: start() checks).
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shutdown or a crash) and takes no requests."""


class AsyncEngine:
    """Runs `engine` on a background thread and streams each request's deltas to asyncio.

    Args:
        engine: a macinfer.engine.protocol.Engine (the paged LLMEngine or the mlx-lm DenseEngine).
        on_step: called on the engine thread after each step with (seconds, deltas).
        on_idle: called on the engine thread about every half second while there is nothing to
            step (across ranks: a heartbeat, macinfer.engine.distributed).

    Example:
        >>> aengine = AsyncEngine(LLMEngine(...)); aengine.start()
        >>> async for delta in aengine.generate(ids, SamplingParams(max_tokens=8)):
        ...     print(delta.text, end="")
    """

    BURST_GAP_S = 0.0005  # _settle: the inbox quiet this long ends a burst
    BURST_MAX_S = 0.003  # _settle waits no longer than this in all

    def __init__(self, engine: Engine, on_step: Callable[[float, list], None] | None = None,
                 on_idle: Callable[[], None] | None = None):
        self.engine = engine
        self.on_step, self.on_idle = on_step, on_idle
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.num_steps = 0
        self.peak_batch = 0  # most requests that moved in one step: > 1 means batching happened
        self.num_aborted = 0  # requests the engine confirmed aborted (client gone)

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        """Start the engine thread. Raises RuntimeError if another AsyncEngine runs this engine:
        two threads stepping one engine would race on its scheduler and pools (and MLX streams
        are per thread)."""
        owner = _OWNERS.get(self.engine)
        if owner is not None and owner is not self and owner.is_running:
            raise RuntimeError("this engine is already served by another AsyncEngine: shut that one down first")
        _OWNERS[self.engine] = self
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="macinfer-engine", daemon=True)
            self._thread.start()
            atexit.register(_stop_at_exit, weakref.ref(self))
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_active(self) -> int:
        return len(self._streams)

    # -- the asyncio side ------------------------------------------------------------
    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
        fork_of: str | None = None, mm=None,
    ) -> AsyncIterator[StreamDelta]:
        """Yield the request's deltas; the last has `finish_reason` and `output` set.

        Closing the iterator early (or cancelling the task) aborts the request. `fork_of`: the
        id of a request with the same prompt, added before, whose prompt blocks this one shares.
        `mm`: the prompt's images (macinfer.modelio.multimodal), or None.

        Raises:
            EngineDeadError: the loop is not running.
            Whatever the engine raised when adding this request (e.g. a too-long prompt).
        """
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running{f' ({self.error})' if self.error else ''}")
        rid = request_id or uuid.uuid4().hex
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        self._send(("add", rid, list(prompt_token_ids), params, fork_of, mm))
        finished = False
        try:
            while not finished:
                item = await q.get()
                # NOTE: finished is set before the last delta is yielded: a caller that stops after it
                # (a route seldom asks for more) must neither count as active nor abort a done request.
                finished = isinstance(item, BaseException) or item.finish_reason is not None
                if finished:
                    self._streams.pop(rid, None)
                if isinstance(item, BaseException):  # the engine has already dropped the request
                    raise item
                yield item
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its KV blocks are freed on the next loop turn."""
        self._send(("abort", request_id))

    def _send(self, msg: tuple) -> None:
        self._inbox.put(msg)
        self._wake.set()

    # -- the engine thread -----------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                idle = not self.engine.has_unfinished()
                if self._drain_inbox() and idle:
                    self._settle()
                if not self.engine.has_unfinished():
                    if not self._wake.wait(timeout=0.5) and self.on_idle is not None:
                        self.on_idle()
                    continue
                t0 = time.perf_counter()
                deltas = self.engine.step()
                self.num_steps += 1
                self.peak_batch = max(self.peak_batch, len(deltas))
                if self.on_step is not None:
                    self.on_step(time.perf_counter() - t0, deltas)
                self.num_aborted += sum(d.finish_reason == "abort" for d in deltas)
                self._deliver_all(deltas)
        except BaseException as e:  # a bug or OOM in the engine: fail every waiter, stop
            log.exception("engine loop crashed")
            self.error = e
            self._stopping = True
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"the engine stopped: {type(e).__name__}: {e}"))
        finally:
            self.engine.release_thread()

    def _settle(self) -> None:
        """Let a burst of requests reach an idle engine before its first step.

        n clients starting together (or one request with n choices) send n requests within a
        fraction of a millisecond, but the engine thread wakes at the first; stepping at once would
        prefill those that arrived so far and make the rest wait behind that whole prefill. So the
        first step waits until the inbox has been quiet for BURST_GAP_S (at most BURST_MAX_S):
        a lone request pays BURST_GAP_S once.
        """
        deadline = time.perf_counter() + self.BURST_MAX_S
        while not self._stopping and time.perf_counter() < deadline and self._wake.wait(self.BURST_GAP_S):
            self._wake.clear()
            self._drain_inbox()

    def _drain_inbox(self) -> int:
        """Add and abort what the inbox holds; returns how many messages it held."""
        n = 0
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return n
            n += 1
            if msg[0] == "add":
                _, rid, ids, params, fork_of, mm = msg
                if rid not in self._streams:
                    continue  # its caller already left
                try:
                    fork = {"fork_of": fork_of} if fork_of else {}  # engines without forks still serve n = 1
                    self.engine.add_request(ids, params, request_id=rid, **fork, **({"mm": mm} if mm is not None else {}))
                except Exception as e:  # bad request: tell that caller only
                    self._deliver(rid, e)
            else:
                try:
                    self.engine.abort_request(msg[1])
                except Exception:  # unknown or already finished: nothing to free
                    log.debug("abort of %s ignored", msg[1], exc_info=True)

    def _deliver_all(self, deltas: list[StreamDelta]) -> None:
        """A step's deltas, one callback per event loop (not one per request).

        Each call_soon_threadsafe wakes the loop's thread, which then competes with this one for
        the GIL: on a fast model, a wake-up per request per step costs a good part of the step.
        """
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for d in deltas:
            entry = self._streams.get(d.request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], d))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed
                for _, d in items:
                    self._streams.pop(d.request_id, None)

    def _deliver(self, rid: str, item) -> None:
        entry = self._streams.get(rid)
        if entry is None:
            return
        loop, q = entry
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # that event loop is closed
            self._streams.pop(rid, None)


def _put_all(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


def _stop_at_exit(ref: weakref.ref) -> None:
    """A process exiting with its engine thread still stepping (nobody called shutdown) stops it first.

    The thread must free its MLX state while Python can still run its destructors
    (LLMEngine.release_thread); a daemon thread cut off inside MLX at exit aborts the process.
    """
    aengine = ref()
    if aengine is not None:
        aengine.shutdown()
