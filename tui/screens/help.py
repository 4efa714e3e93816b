"""The help screen: keys and slash commands."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from macinfer.tui.commands import COMMANDS, KEYS


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,f1,q", "dismiss", "Close"),
    ]

    def compose(self) -> ComposeResult:
        keys = Table.grid(padding=(0, 2))
        keys.add_column(style="bold", no_wrap=True)
        keys.add_column()
        for key, what in KEYS:
            keys.add_row(key, what)
        cmds = Table.grid(padding=(0, 2))
        cmds.add_column(style="bold", no_wrap=True)
        cmds.add_column()
        for c in COMMANDS:
            cmds.add_row(f"/{c.name} {c.usage}".rstrip(), c.help)
        with VerticalScroll(id="help-box") as box:
            box.border_title = "macinfer chat: help"
            box.border_subtitle = "Esc closes"
            yield Static("Keys", classes="panel-title")
            yield Static(keys)
            yield Static("Commands (also in the palette, Ctrl+P)", classes="panel-title")
            yield Static(cmds)
            yield Static("Figures show n/a where this engine cannot measure them.", classes="help-note")
