"""The multi-line prompt: Enter sends, Shift+Enter / Ctrl+J / Alt+Enter start a new line."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")


class PromptInput(TextArea):
    """A TextArea whose Enter submits instead of breaking the line."""

    @dataclass(eq=False)
    class Submitted(Message):
        prompt: "PromptInput"
        text: str

        @property
        def control(self) -> "PromptInput":
            return self.prompt

    def __init__(self, **kwargs):
        kwargs.setdefault("placeholder", "Type a message (/help for commands)")
        super().__init__(soft_wrap=True, tab_behavior="focus", show_line_numbers=False,
                         highlight_cursor_line=False, compact=True, **kwargs)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)

    def set_text(self, text: str) -> None:
        """Replace the contents and put the cursor at the end."""
        self.load_text(text)
        self.move_cursor(self.document.end)
