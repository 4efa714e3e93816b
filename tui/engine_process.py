"""The engine process: the chat's engine (macinfer.tui.runner) in a child process, and the UI's handle on it.

    ui = EngineProcess(partial(ChatBackend, peak_bandwidth=100), screen.post_message)
    ui.start(); ui.submit(Load(None))   # Messages arrive at screen.post_message
    ui.stop()                           # the child closes its backend and exits

Why a process: a thread shares the UI's GIL, so every layout, Markdown parse and
collection in the UI would delay the engine's next step, which on a model decoding
hundreds of tok/s is most of a step. The child is started with "spawn"
(MLX must not be forked) and owns MLX and the model; the UI process never imports
MLX. Commands go down one pipe; Messages come back up another, and a reader thread
in the UI posts them to the screen. Everything crossing pickles, so `make_backend`
must be a module-level function or a functools.partial of one.

The child dies with the UI: it exits when the UI closes the command pipe (`stop`),
and a watchdog thread ends it at once if the UI process is gone (killed, crashed),
even mid-load. If the child dies unasked, the screen gets one EngineStopped line;
the next Load starts a new child.
"""

from __future__ import annotations

import io
import itertools
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import Future
from typing import Callable

from macinfer.tui.messages import EngineOutput, EngineStopped
from macinfer.tui.runner import Call, EngineRunner, Load, Returned, one_line


class EngineProcess:
    """The UI's side of the engine process.

    Args:
        make_backend: builds an unloaded backend for a MODEL spec, in the child (must pickle).
        post: delivers a Message to the UI; called from the reader thread (Widget.post_message is safe).
    """

    STOP_TIMEOUT = 5.0  # seconds the child gets to close its backend before it is killed

    def __init__(self, make_backend: Callable, post: Callable[[object], object]):
        self.make_backend = make_backend
        self.post = post
        self.process: multiprocessing.process.BaseProcess | None = None
        self._commands = None  # our end of the command pipe
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()  # one sender at a time on the command pipe
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def start(self) -> None:
        """Start the child and the reader thread (a second start replaces a dead child)."""
        ctx = multiprocessing.get_context("spawn")
        if self._commands is not None:  # a dead child's
            self._commands.close()
        their_commands, self._commands = ctx.Pipe(duplex=False)
        events, their_events = ctx.Pipe(duplex=False)
        self._stopping = False
        self.process = ctx.Process(target=serve, args=(self.make_backend, their_commands, their_events),
                                   name="macinfer-engine", daemon=True)
        # NOTE: multiprocessing hands sys.stderr's descriptor to the resource tracker it
        # starts with the first child; inside a Textual app sys.stderr is Textual's
        # capture, whose fileno() is -1 ("bad value(s) in fds_to_keep").
        stderr, sys.stderr = sys.stderr, sys.__stderr__
        try:
            self.process.start()
        finally:
            sys.stderr = stderr
        # The child has its own copies now; ours would keep the pipes open after it exits.
        their_commands.close()
        their_events.close()
        self._reader = threading.Thread(target=self._read, args=(events, self.process),
                                        name="macinfer-engine-reader", daemon=True)
        self._reader.start()

    def submit(self, command) -> None:
        """Send a command to the engine; a Load starts a new child if the last one died."""
        if isinstance(command, Load) and not self._stopping and not self.alive():
            self.start()
        try:
            with self._lock:
                self._commands.send(command)
        except OSError:  # the child is gone: the reader posts EngineStopped
            pass

    def call(self, fn: Callable, *args) -> Future:
        """Run fn(backend, *args) in the engine process between steps; a Future of its result.

        fn must pickle (a module-level function, operator.attrgetter / methodcaller),
        and so must what it returns. For tests and tools that look at the engine.
        """
        future: Future = Future()
        with self._lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = future
            try:
                self._commands.send(Call(call_id, fn, args))
            except OSError:
                del self._calls[call_id]
                future.set_exception(RuntimeError("the engine process is not running"))
        return future

    def stop(self) -> None:
        """Close the command pipe (the child closes its backend and exits); kill it if it hangs."""
        if self.process is None:
            return
        self._stopping = True
        with self._lock:
            self._commands.close()
        self.process.join(self.STOP_TIMEOUT)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._reader.join()

    def _read(self, events, process) -> None:
        """The reader thread: post what the child sends until it exits, then say if it died unasked."""
        reported = False
        try:
            while True:
                items = events.recv()
                for item in items if isinstance(items, list) else [items]:  # the runner batches a step's
                    if isinstance(item, Returned):
                        self._resolve(item)
                        continue
                    reported = reported or isinstance(item, EngineStopped)
                    self.post(item)
        except Exception:  # EOFError, or a broken pipe: the child is gone
            pass
        finally:
            events.close()
        for call_id in list(self._calls):
            self._resolve(Returned(call_id, error="the engine process stopped"))
        if not self._stopping and not reported:
            # NOTE: join, not a wait on the sentinel: the sentinel is ready when the child's
            # files close, a moment before it can be reaped, and its exit code is None until then.
            process.join(self.STOP_TIMEOUT)
            self.post(EngineStopped(exit_reason(process.exitcode)))

    def _resolve(self, r: Returned) -> None:
        with self._lock:
            future = self._calls.pop(r.call_id, None)
        if future is None:
            return
        if r.error is None:
            future.set_result(r.value)
        else:
            future.set_exception(RuntimeError(r.error))


def exit_reason(code: int | None) -> str:
    """'the engine process stopped (killed by SIGKILL)': one line for an exit code (negative: a signal)."""
    if code is None:
        return "the engine process stopped"
    if code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    else:
        how = f"exit code {code}"
    return f"the engine process stopped ({how})"


# -- the child ------------------------------------------------------------------------
class _Forward(io.TextIOBase):
    """sys.stdout / sys.stderr of the child: text goes to the UI's log, not over its screen."""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def write(self, text: str) -> int:
        if text.strip():
            try:
                self.events.send(EngineOutput(text))
            except Exception:  # the UI is gone: nobody to tell
                pass
        return len(text)


def _exit_with_parent() -> None:
    """Exit as soon as the parent process is gone, whatever the main thread is doing."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os._exit(0)), name="parent-watch", daemon=True).start()


def serve(make_backend: Callable, commands, events) -> None:
    """The child's main: run the engine loop on this (main) thread until the UI closes `commands`."""
    # A session of its own: the terminal's signals (Ctrl+C, hang-up) go to the UI, which
    # decides what they mean; and where the scheduler shares the CPU out by session
    # (Linux's autogroup), the engine gets its own share instead of splitting the UI's.
    os.setsid()
    _exit_with_parent()
    sys.stdout = sys.stderr = _Forward(events)
    try:
        EngineRunner(make_backend, events.send).run(commands)
    except Exception as e:  # a bug in the loop: say it in one line, the traceback goes to the log
        import traceback

        traceback.print_exc()
        try:
            events.send(EngineStopped(f"the engine process stopped: {type(e).__name__}: {one_line(e)}"))
        except OSError:
            pass
        sys.exit(1)
