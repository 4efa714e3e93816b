"""The server section of the metrics panel (`macinfer chat --url`): the server's own figures.

Polls the server's /metrics about once a second on a worker thread (macinfer.tui.scrape) and shows
KV blocks used / total, requests running and waiting, and, for a model split over ranks,
a row per rank: its active memory and the time one forward's collectives take on it, with
the time rank 0 spends sending each step's plan. A server without /metrics (mlx_lm.server)
gets one line saying so. `figures` holds the displayed strings by name (what the tests read).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Static

from macinfer.errors import MacinferError
from macinfer.tui import scrape
from macinfer.tui.widgets.metrics import Figures

INTERVAL = 1.0  # seconds between scrapes


class ServerPanel(Vertical):
    """Figures from `root`/metrics, for the model the chat screen talks to.

    Args:
        root: the server, http://HOST:PORT.
        api_key: sent with each scrape (a server with --api-key guards /metrics too).
    """

    @dataclass
    class Scraped(Message):
        figures: scrape.ServerFigures | None
        error: str | None = None

    def __init__(self, root: str, api_key: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.root, self.api_key = root, api_key
        self.previous: scrape.ServerFigures | None = None
        self.figures: dict[str, str] = {}
        self.scraping = False

    def compose(self) -> ComposeResult:
        yield Static("Server", classes="panel-title")
        yield Static(Text(self.root, style="dim", no_wrap=True, overflow="ellipsis"), id="server-url")
        yield Figures(["KV used/total", "requests"], id="server-engine")
        yield Static(id="server-note")
        yield Static(id="server-ranks")

    def on_mount(self) -> None:
        self.query_one("#server-note").display = False
        self.poll()
        self.set_interval(INTERVAL, self.poll)

    def poll(self) -> None:
        if not self.scraping:  # a slow server: never more than one scrape in flight
            self.scraping = True
            self.scrape(getattr(self.screen, "model_name", None))

    @work(thread=True, group="scrape")
    def scrape(self, model: str | None) -> None:
        try:
            self.post_message(self.Scraped(scrape.parse(scrape.fetch(self.root, self.api_key), model)))
        except MacinferError as e:
            self.post_message(self.Scraped(None, str(e)))

    def on_server_panel_scraped(self, msg: Scraped) -> None:
        self.scraping = False
        note = self.query_one("#server-note", Static)
        f = msg.figures
        error = msg.error or ("no macinfer figures at /metrics" if f is not None and f.empty else None)
        self.figures = {"note": error} if error else scrape.show(f, self.previous)
        note.display = error is not None
        if error:
            note.update(Text(error, style="dim"))
            self.query_one("#server-engine", Figures).set_values(["n/a", "n/a"])
            self.query_one("#server-ranks", Static).display = False
            return
        self.previous = f
        self.query_one("#server-engine", Figures).set_values([self.figures["kv"], self.figures["requests"]])
        ranks = self.query_one("#server-ranks", Static)
        ranks.display = f.ranks > 1
        ranks.update(self._ranks(f))

    def _ranks(self, f: scrape.ServerFigures) -> Text:
        """A row per rank (rank, memory, comm per forward) and rank 0's plan time; nothing on one rank."""
        if f.ranks <= 1:
            return Text()
        out = Text(no_wrap=True, overflow="ellipsis")
        out.append(f"{f.ranks} ranks: memory, comm/fwd\n", style="dim")
        for r in f.per_rank:
            out.append(f"{r.rank:>2} ", style="dim")
            out.append(self.figures[f"rank {r.rank}"] + "\n")
        out.append("plan send ", style="dim")  # rank 0's time per plan (idle heartbeats included)
        out.append(self.figures["plan"])
        return out
