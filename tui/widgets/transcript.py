"""The conversation as it scrolls by: user turns, streamed Markdown replies, notices."""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream


class Reply(Markdown):
    """An assistant reply, rendered as Markdown while it streams."""

    def __init__(self, **kwargs):
        super().__init__("", classes="turn assistant", **kwargs)
        self.chunks: list[str] = []
        self.stream: MarkdownStream | None = None

    async def write(self, text: str) -> None:
        self.chunks.append(text)
        if self.stream is None:
            self.stream = Markdown.get_stream(self)
        await self.stream.write(text)

    async def finish(self) -> str:
        """Stop streaming; returns the whole reply text."""
        if self.stream is not None:
            await self.stream.stop()
            self.stream = None
        return self.text

    @property
    def text(self) -> str:
        return "".join(self.chunks)


class Transcript(VerticalScroll):
    """Holds the turns; stays scrolled to the bottom unless the user scrolls up."""

    can_focus = False

    def on_mount(self) -> None:
        self.anchor()

    async def add_user(self, text: str) -> None:
        await self.mount(Static(text, markup=False, classes="turn user"))
        self.anchor()

    async def add_reply(self) -> Reply:
        reply = Reply()
        await self.mount(reply)
        self.anchor()
        return reply

    async def add_notice(self, text: str, error: bool = False) -> Static:
        notice = Static(text, markup=False, classes="notice error" if error else "notice")
        await self.mount(notice)
        self.anchor()
        return notice

    async def clear(self) -> None:
        await self.remove_children()
