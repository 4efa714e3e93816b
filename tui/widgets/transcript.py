"""The conversation as it scrolls by: user turns, streamed Markdown replies, notices."""

from __future__ import annotations

import asyncio
import time

from textual.containers import VerticalScroll
from textual.widgets import Markdown, Static


class Reply(Markdown):
    """An assistant reply, rendered as Markdown while it streams.

    Text arrives faster than Textual can re-parse and re-lay-out Markdown on a fast
    model. So `write` only queues the text, and a pump task appends what has queued
    to the Markdown document at most every INTERVAL seconds, and further apart when an
    update (append, layout, repaint: UI-thread CPU time) is costly, so that updates
    take at most BUDGET of the UI thread's time and keys stay responsive. `finish`
    appends whatever is left: the document then holds every piece written, in order
    (`text`). NOTE: the engine runs in another process, so a larger BUDGET no longer
    slows it; it leaves less text for `finish`, which the user waits for after the
    last token.
    """

    INTERVAL = 0.05
    BUDGET = 0.5

    def __init__(self, **kwargs):
        super().__init__("", classes="turn assistant", **kwargs)
        self.chunks: list[str] = []  # every piece written, in order
        self.pending: list[str] = []  # written, not yet in the Markdown document
        self.updates = 0  # Markdown appends made
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._pump: asyncio.Task | None = None
        self._finished = False

    def write(self, text: str) -> None:
        """Queue streamed text; the pump shows it soon (never blocks, never drops)."""
        if not text:
            return
        if self._finished:
            raise RuntimeError("write after finish")
        self.chunks.append(text)
        self.pending.append(text)
        if self._pump is None:
            self._pump = asyncio.create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        next_at = 0.0
        while True:
            await self._wake.wait()
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            self._wake.clear()
            cpu = time.thread_time()
            await asyncio.shield(self._append_pending())
            await self.wait_for_refresh()  # the layout and repaint the append caused
            cost = time.thread_time() - cpu
            next_at = time.perf_counter() + max(self.INTERVAL, cost * (1 / self.BUDGET - 1))

    async def _append_pending(self) -> None:
        async with self._lock:
            if self.pending and self.is_attached:  # (not after /clear took the reply off the screen)
                text = "".join(self.pending)
                self.pending.clear()
                self.updates += 1
                await self.append(text)

    async def finish(self) -> str:
        """Stop streaming, with every written piece in the document; returns the whole reply text."""
        self._finished = True
        if self._pump is not None:
            self._pump.cancel()
            try:
                await self._pump
            except asyncio.CancelledError:
                pass
            self._pump = None
        await self._append_pending()  # after any append in flight (the lock), the rest
        return self.text

    def on_unmount(self) -> None:
        if self._pump is not None:
            self._pump.cancel()

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

    async def add_turns(self, turns: list[dict]) -> None:
        """Show earlier turns (a loaded conversation) as if they had just been written."""
        for t in turns:
            if t["role"] == "user":
                await self.add_user(t["content"])
            else:
                reply = await self.add_reply()
                reply.write(t["content"])
                await reply.finish()

    async def add_notice(self, text: str, error: bool = False) -> Static:
        notice = Static(text, markup=False, classes="notice error" if error else "notice")
        await self.mount(notice)
        self.anchor()
        return notice

    async def clear(self) -> None:
        await self.remove_children()
