"""ChatApp: the session, the engine process, the command palette."""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterable

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from macinfer.tui.backend import ChatBackend
from macinfer.tui.commands import COMMANDS
from macinfer.tui.engine_process import EngineProcess
from macinfer.tui.messages import EngineOutput
from macinfer.tui.remote import RemoteBackend, server_root
from macinfer.tui.runner import Load
from macinfer.tui.screens.chat import ChatScreen
from macinfer.tui.session import ChatSession


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
        make_backend: builds the backend for a MODEL spec in the engine process (tests inject
            their own): it must pickle, so a module-level function or a functools.partial.
        url, api_key: chat with the model `model` (None: the first listed) on this OpenAI-compatible
            server instead (macinfer.tui.remote), and show its /metrics (macinfer.tui.widgets.server).
    """

    CSS_PATH = "app.tcss"
    TITLE = "macinfer chat"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True)]

    def __init__(self, model: str | None = None, *, dequantize: bool | None = None, peak_bandwidth: float | None = None,
                 system: str = "", temperature: float = 0.0, max_tokens: int = 512, seed: int | None = None,
                 engine_options: dict | None = None, session: ChatSession | None = None,
                 resumed_from: str | None = None,
                 make_backend: Callable[[str | None], ChatBackend] | None = None,
                 url: str | None = None, api_key: str | None = None):
        super().__init__()
        self.model_spec = model
        self.session = session or ChatSession(system=system, temperature=temperature, max_tokens=max_tokens, seed=seed)
        self.resumed_from = resumed_from
        self.server = server_root(url) if url else None
        self.api_key = api_key
        if self.server:
            make_backend = make_backend or partial(RemoteBackend, url=self.server, api_key=api_key)
        self.make_backend = make_backend or partial(ChatBackend, dequantize=dequantize, peak_bandwidth=peak_bandwidth,
                                                    **(engine_options or {}))
        self.chat = ChatScreen()
        self.engine = EngineProcess(self.make_backend, self.chat.post_message)

    def get_default_screen(self) -> Screen:
        return self.chat

    def on_mount(self) -> None:
        # After the first frame: starting a Python process takes a moment, and the user
        # should see the loading bar meanwhile, not a blank terminal.
        self.call_after_refresh(self.start_engine)

    def on_unmount(self) -> None:
        self.engine.stop()

    def start_engine(self) -> None:
        self.engine.start()
        self.engine.submit(Load(self.model_spec))

    def on_engine_output(self, msg: EngineOutput) -> None:
        """(Bubbled up from the chat screen.) What the engine process printed goes to the log."""
        self.log(msg.text.rstrip())

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for c in COMMANDS:
            yield SystemCommand(c.palette, f"/{c.name} {c.usage}: {c.help}", partial(self.chat.palette, c.name))
