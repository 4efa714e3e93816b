"""The conversation as it scrolls by: user turns, streamed Markdown replies, notices."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

from textual.containers import Vertical, VerticalScroll
from textual.widgets import Collapsible, Markdown, Static

FENCE = re.compile(r"^ {0,3}(```|~~~)", re.MULTILINE)


def complete_blocks(text: str) -> tuple[str, str]:
    """Split Markdown `text` after its last blank line outside a code fence: (complete blocks, the rest).

    A display heuristic only (the Markdown widget re-parses its last block on every
    append, so any split gives the same document): it keeps a paragraph or code block
    in progress out of the Markdown until it is whole.

        complete_blocks("# Hi\\n\\nSome te") == ("# Hi\\n\\n", "Some te")
    """
    cut = text.rfind("\n\n")
    while cut >= 0 and len(FENCE.findall(text, 0, cut)) % 2:  # inside a fence: look further back
        cut = text.rfind("\n\n", 0, cut)
    return (text[:cut + 2], text[cut + 2:]) if cut >= 0 else ("", text)


class Thought(Collapsible):
    """A reply's thought, above it: open and live while the model thinks, then folded, titled with
    how long it took and its token count ("thought for 3.2 s · 120 tokens")."""

    DEFAULT_CSS = """
    Thought {
        margin: 1 0 0 1;
        padding: 0;
        border: none;
        background: transparent;
    }
    Thought .thought-text {
        color: $text-muted;
        padding: 0 1 0 1;
    }
    """

    def __init__(self, text: str = "", done: bool = False, title: str = "thinking"):
        self.body = Static(text.strip(), markup=False, classes="thought-text")
        super().__init__(self.body, title=title, collapsed=done)
        self.text = text

    def add(self, text: str, tokens: int, seconds: float, done: bool) -> None:
        self.text += text
        if text:
            self.body.update(self.text.strip())
        self.title = thought_title(tokens, seconds, done)
        if done:
            self.collapsed = True


def thought_title(tokens: int, seconds: float, done: bool) -> str:
    """'thinking… 12 tokens' while live; 'thought for 3.2 s · 120 tokens' once done."""
    count = f"{tokens} token{'s' if tokens != 1 else ''}"
    return f"thought for {seconds:.1f} s · {count}" if done else f"thinking… {count}"


class Reply(Vertical):
    """An assistant reply: its text as it streams, its Markdown a few blocks at a time.

    Laying out the screen after a Markdown update (and re-rendering it) costs the UI tens of
    ms, more as the reply grows, and a fast model writes a line every 50 ms: so while the
    reply streams, a pump task shows new text at most every INTERVAL seconds in two ways:

    - in the tail, plain text below the Markdown: a repaint of that one widget, no layout
      pass. Its height is that of its text at the last layout plus SLACK blank lines; a
      line beyond them shows at the next layout.
    - at a layout, at most every LAYOUT_INTERVAL seconds and further apart when one is
      costly (so that layouts take at most BUDGET of the UI thread's time): the complete
      blocks (complete_blocks) move from the tail to the Markdown document, and the tail
      takes the height of what is left.

    `finish` appends the rest and hides the tail: the document then holds every piece
    written, in order (`text`). NOTE: the engine runs in another process; the UI's time
    matters to it only as CPU taken from it on a machine with few cores.
    """

    DEFAULT_CSS = """
    Reply {
        height: auto;
    }
    """
    INTERVAL = 0.05
    LAYOUT_INTERVAL = 0.2
    BUDGET = 0.5
    SLACK = 2
    MAX_TAIL = 2000  # characters: a longer block in progress goes to the Markdown unfinished

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.markdown = Markdown("", classes="turn assistant")
        self.tail = Static("", markup=False, classes="reply-tail")
        self.chunks: list[str] = []  # every piece written, in order
        self.pending: list[str] = []  # written, not yet in the Markdown document (the tail's text)
        self.updates = 0  # Markdown appends made
        self.repaints = 0  # tail-only updates made
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._pump: asyncio.Task | None = None
        self._layout_at = 0.0  # perf_counter time after which the next show may lay out
        self._finished = False
        self.thought_block: Thought | None = None

    def compose(self):
        yield self.markdown
        yield self.tail

    @property
    def thought(self) -> str:
        """The reply's thought ("" if the model did not think)."""
        return self.thought_block.text if self.thought_block is not None else ""

    async def think(self, text: str, tokens: int, seconds: float, done: bool) -> None:
        """More of the thought (the block is mounted above the reply on the first piece)."""
        if self.thought_block is None:
            self.thought_block = Thought(title=thought_title(tokens, seconds, done))
            await self.mount(self.thought_block, before=self.markdown)
        self.thought_block.add(text, tokens, seconds, done)

    @property
    def source(self) -> str:
        """The Markdown document's source."""
        return self.markdown.source

    @property
    def text(self) -> str:
        return "".join(self.chunks)

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
            await asyncio.shield(self.show(time.perf_counter()))
            next_at = time.perf_counter() + self.INTERVAL

    async def show(self, now: float) -> None:
        """Show the text written so far: in the tail, or at a layout (if one is due at `now`) in both."""
        if not self.pending or not self.is_attached:  # (not after /clear took the reply off the screen)
            return
        if now < self._layout_at:
            self._show_tail(layout=False)
            return
        cpu = time.thread_time()
        async with self._lock:
            done, rest = complete_blocks("".join(self.pending))
            if len(rest) > self.MAX_TAIL:
                done, rest = done + rest, ""
            self.pending[:] = [rest] if rest else []
            if done:
                await self._append(done)
            self._show_tail(layout=True)
        await self.wait_for_refresh()  # the layout and repaint this caused
        cost = time.thread_time() - cpu
        self._layout_at = now + max(self.LAYOUT_INTERVAL, cost * (1 / self.BUDGET - 1))

    def _show_tail(self, layout: bool) -> None:
        self.tail.update("".join(self.pending) + "\n" * self.SLACK, layout=layout)
        self.repaints += not layout

    async def _append(self, text: str) -> None:
        self.updates += 1
        await self.markdown.append(text)

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
        async with self._lock:  # after any append in flight, the rest
            if self.is_attached:
                if self.pending:
                    text = "".join(self.pending)
                    self.pending.clear()
                    await self._append(text)
                self.tail.display = False  # (not remove: that waits on the tail's message queue)
        return self.text

    def on_unmount(self) -> None:
        if self._pump is not None:
            self._pump.cancel()


class Transcript(VerticalScroll):
    """Holds the turns; stays scrolled to the bottom unless the user scrolls up."""

    can_focus = False

    def on_mount(self) -> None:
        self.anchor()

    async def add_user(self, text: str, images: list[str] | tuple = ()) -> None:
        """A user turn; its attached images (paths) are named above its text."""
        shown = "".join(f"[image: {Path(p).name}]\n" for p in images) + text
        await self.mount(Static(shown, markup=False, classes="turn user"))
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
                await self.add_user(t["content"], t.get("images", ()))
            else:
                reply = await self.add_reply()
                if t.get("reasoning"):
                    reply.thought_block = Thought(t["reasoning"], done=True, title="thought")
                    await reply.mount(reply.thought_block, before=reply.markdown)
                reply.write(t["content"])
                await reply.finish()

    async def add_notice(self, text: str, error: bool = False) -> Static:
        notice = Static(text, markup=False, classes="notice error" if error else "notice")
        await self.mount(notice)
        self.anchor()
        return notice

    async def clear(self) -> None:
        await self.remove_children()
