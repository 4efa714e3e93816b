"""Model loading / conversion progress: a label and a bar (indeterminate when total is None)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar


class LoadingBar(Horizontal):
    def compose(self) -> ComposeResult:
        yield Label("loading", id="loading-label")
        yield ProgressBar(total=None, show_eta=False, id="loading-bar")

    def show(self, what: str, done: int = 0, total: int | None = None) -> None:
        self.display = True
        self.query_one("#loading-label", Label).update(what)
        bar = self.query_one(ProgressBar)
        bar.update(total=total, progress=done if total else 0)

    def hide(self) -> None:
        self.display = False
        self.query_one(ProgressBar).update(total=1, progress=1)  # stops the 15 Hz indeterminate animation
