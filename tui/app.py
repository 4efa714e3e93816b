"""ChatApp: the session, the engine worker, the command palette."""

from __future__ import annotations

import gc
import sys
from functools import partial
from typing import Callable, Iterable

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.worker import get_current_worker

from tui.backend import ChatBackend
from tui.commands import COMMANDS
from tui.messages import ModelLoaded
from tui.runner import EngineRunner, Load
from tui.screens.chat import ChatScreen
from tui.session import ChatSession


class ChatApp(App):
    """Chat with a local model and watch TTFT, decode speed, bandwidth and the KV cache live.

    Args:
        model: MODEL as `macinfer run` takes it (None: the embedded default).
        dequantize: load quantised weights as float32.
        peak_bandwidth: GB/s override for the bandwidth figure (default: detected or probed).
        system, temperature, max_tokens, seed: the session's starting settings.
        session, resumed_from: a conversation loaded from a /save file (`macinfer chat --resume`)
            and that file's name; it replaces the settings above.
        engine_options: passed to the engine (e.g. kv_memory="2GB").
        make_backend: builds the backend for a MODEL spec (tests inject their own).
    """

    # NOTE: the engine thread drops the GIL inside every MLX eval and then waits for the
    # UI thread to hand it back, up to the switch interval (5 ms by default): on a fast
    # model that wait is a whole decode step. 0.5 ms measured ~0.63x -> ~0.75x of bare
    # decode speed on a tiny model (python -m tui.overhead); 0.1 ms, with a 1 ms step
    # (python -m tui.overhead --stub-rate 1000, 4 rounds each, alternating on a loaded
    # 2-core Linux box): median 0.27x -> 0.43x. The UI thread yields sooner, which is the point.
    SWITCH_INTERVAL = 0.0001

    CSS_PATH = "app.tcss"
    TITLE = "macinfer chat"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True)]

    def __init__(self, model: str | None = None, *, dequantize: bool | None = None, peak_bandwidth: float | None = None,
                 system: str = "", temperature: float = 0.0, max_tokens: int = 512, seed: int | None = None,
                 engine_options: dict | None = None, session: ChatSession | None = None,
                 resumed_from: str | None = None,
                 make_backend: Callable[[str | None], ChatBackend] | None = None):
        super().__init__()
        self.model_spec = model
        self.session = session or ChatSession(system=system, temperature=temperature, max_tokens=max_tokens, seed=seed)
        self.resumed_from = resumed_from
        options = engine_options or {}
        self.make_backend = make_backend or (lambda spec: ChatBackend(
            spec, dequantize=dequantize, peak_bandwidth=peak_bandwidth, **options))
        self.chat = ChatScreen()
        self.runner = EngineRunner(self.make_backend, self.chat.post_message)

    def get_default_screen(self) -> Screen:
        return self.chat

    def on_mount(self) -> None:
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(self.SWITCH_INTERVAL)
        # After the first frame: the engine thread's imports (MLX, mlx-lm) hold the GIL for
        # seconds, and the user should see the loading bar, not a blank terminal, meanwhile.
        self.call_after_refresh(self.start_engine)

    def on_unmount(self) -> None:
        sys.setswitchinterval(self._switch_interval)
        gc.unfreeze()

    def on_model_loaded(self, msg: ModelLoaded) -> None:
        """(Bubbled up from the chat screen.) Freeze the heap once the model is loaded."""
        self.call_after_refresh(self.freeze_heap)

    @staticmethod
    def freeze_heap() -> None:
        """Collect, then move every live object into the GC's permanent generation.

        NOTE: a full collection holds the GIL for its whole pass, and with MLX, mlx-lm
        and transformers imported the heap is hundreds of thousands of objects: tens to
        hundreds of ms in which the engine thread cannot run (a stall in the stream).
        Frozen objects are skipped by later collections, which then scan only what the
        chat made since. Frozen objects are still freed by reference counting; only
        reference cycles among them stay until `gc.unfreeze()` (on unmount).
        """
        gc.collect()
        gc.freeze()

    def start_engine(self) -> None:
        self.run_engine()
        self.runner.submit(Load(self.model_spec))

    @work(thread=True, exclusive=True, group="engine", exit_on_error=True)
    def run_engine(self) -> None:
        """The one thread that owns the engine (see tui.runner)."""
        worker = get_current_worker()
        self.runner.run(lambda: worker.is_cancelled)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for c in COMMANDS:
            yield SystemCommand(c.palette, f"/{c.name} {c.usage}: {c.help}", partial(self.chat.palette, c.name))
