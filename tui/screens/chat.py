"""The chat screen: transcript, prompt, metrics panel; turns engine Messages into UI.

The screen never calls the engine: it submits commands to the app's EngineProcess
(a pipe to the engine process) and reacts to the Messages the engine sends back.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from macinfer.errors import MacinferError
from macinfer.modelio.images import read_image
from macinfer.tui import commands
from macinfer.tui.messages import (EngineNotice, EngineStopped, LoadFailed, LoadProgress, ModelLoaded, ReplyFailed,
                          ReplyFinished, ReplyText, ReplyThought, StatsUpdate)
from macinfer.tui.runner import Abort, Generate, Load, SetOption
from macinfer.tui.session import ChatSession
from macinfer.tui.widgets import LoadingBar, MetricsPanel, PromptInput, Transcript
from macinfer.tui.widgets.server import ServerPanel
from macinfer.tui.widgets.transcript import Reply


class ChatScreen(Screen):
    BINDINGS = [
        Binding("escape", "cancel", "Cancel reply"),
        Binding("f1", "help", "Help"),
        Binding("f2", "toggle_metrics", "Metrics"),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("pageup", "scroll_transcript(-1)", "Scroll up", show=False),
        Binding("pagedown", "scroll_transcript(1)", "Scroll down", show=False),
    ]
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]

    def __init__(self):
        super().__init__()
        self.loading_what: str | None = "starting"  # what is loading, None when idle
        self.request_id: str | None = None  # the reply in progress
        self.cancelling = False
        self.status_text = ""
        self.reply: Reply | None = None
        self.model_name: str | None = None
        self.card = None
        self.attached: list[str] = []  # /image paths that go with the next message

    @property
    def ready(self) -> bool:
        """A model is loaded, no load is pending and no reply is running."""
        return self.model_name is not None and self.loading_what is None and self.request_id is None

    @property
    def session(self):
        return self.app.session

    @property
    def engine(self):
        return self.app.engine

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield Transcript(id="transcript")
                yield LoadingBar(id="loading")
                yield Static(id="status")
                yield PromptInput(id="prompt")
            yield MetricsPanel(id="metrics")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one(PromptInput).focus()
        self.query_one(LoadingBar).show(self.loading_what)
        if self.app.resumed_from:
            await self.show_resumed(self.app.resumed_from, self.app.model_spec)
        if self.app.server:  # `chat --url`: the server's own figures, polled from its /metrics
            await self.query_one(MetricsPanel).mount(ServerPanel(self.app.server, self.app.api_key, id="server"))
        self._show_status()

    # -- engine messages ------------------------------------------------------------
    def on_load_progress(self, msg: LoadProgress) -> None:
        self.loading_what = msg.what
        self.query_one(LoadingBar).show(msg.what, msg.done, msg.total)
        self._show_status()

    async def on_model_loaded(self, msg: ModelLoaded) -> None:
        first = self.model_name is None
        changed = self.model_name != msg.card.name
        self.card = msg.card
        self.model_name = msg.card.name
        self.loading_what = None
        self.query_one(LoadingBar).hide()
        panel = self.query_one(MetricsPanel)
        panel.set_model(msg.card)
        panel.update_stats(msg.stats)
        self.sub_title = msg.card.name
        if first:
            await self._notice(f"Chatting with {msg.card.name}. Enter sends, Ctrl+J adds a line, "
                               "Esc cancels a reply, F1 shows keys and /commands.")
        elif changed:
            await self._notice(f"switched to {msg.card.name}")
        self._show_status()

    async def on_load_failed(self, msg: LoadFailed) -> None:
        self.loading_what = None
        self.query_one(LoadingBar).hide()
        await self._notice(f"could not load {msg.spec or 'the default model'}: {msg.error}", error=True)
        if msg.current:
            await self._notice(f"still using {msg.current}")
        else:
            self.model_name, self.card = None, None
            await self._notice("no model loaded: /model MODEL loads one", error=True)
        self._show_status()

    def on_reply_text(self, msg: ReplyText) -> None:
        if msg.request_id == self.request_id and self.reply is not None:
            self.reply.write(msg.text)

    async def on_reply_thought(self, msg: ReplyThought) -> None:
        if msg.request_id == self.request_id and self.reply is not None:
            await self.reply.think(msg.text, msg.tokens, msg.seconds, msg.done)

    def on_stats_update(self, msg: StatsUpdate) -> None:
        self.query_one(MetricsPanel).update_stats(msg.stats)
        if self.request_id is not None and not self.cancelling:
            s = msg.stats
            waiting = f"prefilling {s.prompt_tokens} prompt tokens" if s.prompt_tokens else "waiting for the server"
            self._show_status(f"{waiting}: Esc cancels" if not s.generated_tokens else "generating: Esc cancels")

    async def on_reply_finished(self, msg: ReplyFinished) -> None:
        if msg.request_id != self.request_id:
            return
        text = await self.reply.finish() if self.reply else ""
        self.session.add("assistant", text, reasoning=self.reply.thought if self.reply else None)
        self.query_one(MetricsPanel).update_stats(msg.stats)
        self.request_id, self.reply, self.cancelling = None, None, False
        if msg.finish_reason == "abort":
            await self._notice("(reply cancelled)")
        elif msg.finish_reason == "length":
            await self._notice(f"(reply cut at the {self.session.max_tokens}-token limit: /max-tokens N raises it)")
        self._show_status()

    async def on_reply_failed(self, msg: ReplyFailed) -> None:
        if msg.request_id == self.request_id:
            await self._end_reply(msg.error)

    async def on_engine_stopped(self, msg: EngineStopped) -> None:
        """The engine process is gone: end the reply in flight and forget the model, in one line."""
        self.loading_what, self.model_name, self.card = None, None, None
        self.query_one(LoadingBar).hide()
        text = f"{msg.error}: /model MODEL starts it again"
        if self.request_id is not None:
            await self._end_reply(text)
        else:
            await self._notice(text, error=True)
            self._show_status()

    async def _end_reply(self, error: str) -> None:
        """The reply in progress failed: keep what it wrote, drop its prompt from the history."""
        if self.reply is not None:
            await self.reply.finish()
            if not self.reply.text:
                await self.reply.remove()
        # The prompt got no reply: take it out of the history so the next turn is consistent.
        if self.session.turns and self.session.turns[-1]["role"] == "user":
            self.session.turns.pop()
        self.request_id, self.reply, self.cancelling = None, None, False
        await self._notice(error, error=True)
        self._show_status()

    async def on_engine_notice(self, msg: EngineNotice) -> None:
        await self._notice(msg.text, error=msg.error)

    # -- prompt ---------------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def submit(self, event: PromptInput.Submitted) -> None:
        text = event.text.strip()
        if not text:
            return
        parsed = commands.parse(text)
        if parsed is not None:
            event.prompt.clear()
            await self.run_command(*parsed)
            return
        if text.startswith("//"):
            text = text[1:]
        if self.request_id is not None:
            self.notify("A reply is in progress: Esc cancels it.", severity="warning")
            return
        if self.model_name is None or self.loading_what is not None:
            self.notify("No model is ready yet: wait for loading, or /model MODEL.", severity="warning")
            return
        event.prompt.clear()
        await self.send(text)

    async def send(self, text: str) -> None:
        """Add the user turn (with the images /image attached) and ask the engine for a reply."""
        transcript = self.query_one(Transcript)
        images, self.attached = self.attached, []
        await transcript.add_user(text, images)
        self.session.add("user", text, images=images)
        self.reply = await transcript.add_reply()
        self.request_id = uuid.uuid4().hex[:12]
        self.engine.submit(Generate(self.request_id, self.session.messages(), self.session.params(), self.session.think))
        self._show_status()

    # -- actions --------------------------------------------------------------------
    def action_cancel(self) -> None:
        if self.request_id is not None:
            self.engine.submit(Abort(self.request_id))
            self.cancelling = True
            self._show_status("cancelling")

    def action_help(self) -> None:
        from macinfer.tui.screens.help import HelpScreen

        self.app.push_screen(HelpScreen())

    def action_toggle_metrics(self) -> None:
        panel = self.query_one(MetricsPanel)
        panel.display = not panel.display

    async def action_clear(self) -> None:
        await self.run_command("clear", "")

    def action_scroll_transcript(self, direction: int) -> None:
        t = self.query_one(Transcript)
        (t.scroll_page_down if direction > 0 else t.scroll_page_up)()

    def palette(self, name: str) -> None:
        """A command palette entry: run it, or prefill the prompt when it needs an argument."""
        cmd = commands.BY_NAME[name]
        prompt = self.query_one(PromptInput)
        if cmd.usage and not cmd.usage.startswith("["):
            prompt.set_text(f"/{name} ")
            prompt.focus()
        else:
            self.run_worker(self.run_command(name, ""))

    # -- slash commands -------------------------------------------------------------
    async def run_command(self, name: str, arg: str) -> None:
        handler = getattr(self, f"cmd_{name.replace('-', '_')}", None)
        if name not in commands.BY_NAME or handler is None:
            await self._notice(f"unknown command /{name}: /help lists them", error=True)
            return
        try:
            await handler(arg)
        except ValueError as e:
            await self._notice(f"/{name}: {e}", error=True)
        self._show_status()

    async def cmd_model(self, arg: str) -> None:
        if not arg and self.app.server:
            await self._notice(f"model: {self.model_name or 'none'} on {self.app.server}. "
                               "/model NAME switches to another model it serves")
            return
        if not arg:
            from macinfer.modelio.loader import read_catalog

            names = ", ".join(read_catalog().get("models", {}))
            await self._notice(f"model: {self.model_name or 'none'}. /model MODEL switches (catalog: {names})")
            return
        await self._switch_model(arg)

    async def _switch_model(self, spec: str | None) -> None:
        self.action_cancel()
        self.loading_what = f"loading {spec or 'the default model'}"
        self.engine.submit(Load(spec))
        await self._notice(self.loading_what)

    async def cmd_system(self, arg: str) -> None:
        if not arg:
            await self._notice(f"system prompt: {self.session.system!r}" if self.session.system
                               else "no system prompt: /system TEXT sets one")
        elif arg == "-":
            self.session.system = ""
            await self._notice("system prompt removed")
        else:
            self.session.system = arg
            await self._notice(f"system prompt set: {arg}")

    async def cmd_clear(self, arg: str) -> None:
        self.action_cancel()
        self.request_id, self.reply, self.cancelling = None, None, False
        self.session.clear()
        await self.query_one(Transcript).clear()
        await self._notice("conversation cleared" + (" (system prompt kept)" if self.session.system else ""))

    async def cmd_image(self, arg: str) -> None:
        """Attach an image to the next message (checked here; the engine process reads it again)."""
        if not arg:
            names = ", ".join(Path(p).name for p in self.attached)
            await self._notice(f"attached to your next message: {names}" if names
                               else "no image attached: /image FILE attaches one (/image - drops them)")
            return
        if arg == "-":
            self.attached = []
            await self._notice("attached images dropped")
            return
        path = Path(arg).expanduser().resolve()
        try:
            image = read_image(path, str(path))
        except MacinferError as e:
            raise ValueError(str(e)) from None
        self.attached.append(str(path))
        await self._notice(f"[image: {path.name}] {image.size[0]}x{image.size[1]}, attached to your next message")

    async def cmd_temp(self, arg: str) -> None:
        await self._set_session_value("temperature", arg, float, "a number", "temperature {:g}",
                                      note=lambda t: " (greedy)" if t == 0 else "")

    async def cmd_max_tokens(self, arg: str) -> None:
        await self._set_session_value("max_tokens", arg, int, "a whole number", "max tokens {}")

    async def _set_session_value(self, attr: str, arg: str, parse, kind: str, shown: str,
                                 note=lambda value: "") -> None:
        """Show a sampling setting, or set it if SamplingParams accepts the new value (else keep the old)."""
        if not arg:
            await self._notice(shown.format(getattr(self.session, attr)))
            return
        try:
            value = parse(arg)
        except ValueError:
            raise ValueError(f"expected {kind}, got '{arg}'") from None
        old = getattr(self.session, attr)
        setattr(self.session, attr, value)
        try:
            self.session.params()
        except ValueError:
            setattr(self.session, attr, old)
            raise
        await self._notice(shown.format(value) + note(value))

    async def _toggle(self, option: str, label: str, arg: str) -> None:
        current = getattr(self.card, option, None) if self.card else None
        if current is None:
            await self._notice(f"{label}: n/a (not available in this engine yet)", error=True)
            return
        self.engine.submit(SetOption(option, commands.parse_switch(arg, current)))

    async def cmd_think(self, arg: str) -> None:
        """/think on|off: enable_thinking for the template from the next reply on (a model that thinks)."""
        if not arg and self.session.think is None:
            await self._notice("thinking: the model's default. /think on or /think off sets it")
            return
        self.session.think = commands.parse_switch(arg, self.session.think is not False)
        await self._notice(f"thinking {'on' if self.session.think else 'off'} (for a model that thinks)")

    async def cmd_spec(self, arg: str) -> None:
        await self._toggle("speculation", "speculative decoding", arg)

    async def cmd_prefix_cache(self, arg: str) -> None:
        await self._toggle("prefix_cache", "prefix cache", arg)

    async def cmd_save(self, arg: str) -> None:
        if not arg:
            raise ValueError("give a file name, e.g. /save chat.json")
        spec = self.card.spec if self.card else self.app.model_spec
        path = self._write(lambda: self.session.save(arg, spec), arg)
        await self._notice(f"saved {len(self.session.turns)} turns to {path}: /load {arg} or "
                           f"macinfer chat --resume {arg} brings them back")

    async def cmd_export(self, arg: str) -> None:
        if not arg:
            raise ValueError("give a file name, e.g. /export chat.md")
        path = self._write(lambda: self.session.export(arg, self.model_name), arg)
        await self._notice(f"exported {len(self.session.turns)} turns to {path}")

    @staticmethod
    def _write(save, arg: str):
        try:
            return save()
        except OSError as e:
            raise ValueError(f"could not write {arg}: {e.strerror or e}") from None

    async def cmd_load(self, arg: str) -> None:
        if not arg:
            raise ValueError("give a file name, e.g. /load chat.json")
        loaded, spec = ChatSession.load(arg)
        await self.cmd_clear("")
        self.app.session = loaded
        await self.show_resumed(arg, spec)

    async def show_resumed(self, source: str, spec: str | None) -> None:
        """Show the session's turns (just loaded from `source`) and load its model if another is running."""
        await self.query_one(Transcript).add_turns(self.session.turns)
        await self._notice(f"loaded {len(self.session.turns)} turns from {source}")
        current = self.card.spec if self.card else self.app.model_spec
        if self.card is not None and spec != current:
            await self._switch_model(spec)

    async def cmd_help(self, arg: str) -> None:
        self.action_help()

    # -- helpers --------------------------------------------------------------------
    async def _notice(self, text: str, error: bool = False) -> None:
        await self.query_one(Transcript).add_notice(text, error=error)

    def _show_status(self, state: str | None = None) -> None:
        if state is None:
            if self.request_id is not None:
                state = "generating: Esc cancels"
            elif self.loading_what is not None:
                state = self.loading_what
            elif self.model_name is None:
                state = "no model: /model MODEL"
            else:
                state = "ready"
        s = self.session
        temp = "greedy" if s.temperature == 0 else f"temp {s.temperature:g}"
        system = ", system prompt set" if s.system else ""
        text = f"{state} | {temp}, max {s.max_tokens} tok{system}"
        status = self.query_one("#status", Static)
        if text != self.status_text:  # one fixed line: repaint only, no layout pass
            self.status_text = text
            status.update(Text(text, no_wrap=True, overflow="ellipsis"), layout=False)
