"""The live metrics panel: why this reply is fast or slow.

Every figure is measured in the engine process and arrives in a Stats / ModelCard
message; a figure the engine cannot measure shows "n/a", one not measured yet "-".
`figures` holds the displayed strings by name (what the tests read).
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widget import Widget
from textual.widgets import Sparkline, Static

from macinfer import units
from macinfer.tui.messages import ModelCard, Stats

NA, UNSET = "n/a", "-"


def fmt_bytes(n: float | None) -> str:
    return UNSET if n is None else units.fmt_bytes(n)


def fmt_params(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.0f}K"


def _num(x: float | None, spec: str, unit: str = "") -> str:
    return UNSET if x is None else f"{format(x, spec)}{unit}"


def _percent(fraction: float | None) -> str:
    if fraction is None:
        return UNSET
    p = 100 * fraction
    return f"{p:.1f}%" if p >= 1 else f"{p:.2g}%"  # tiny models on a fast chip use ~0.01%


class Figures(Widget):
    """Rows of `label      value`, right-aligned to the width; a fixed height, so
    updating repaints only this widget (no layout pass: cheap at 15 updates/s)."""

    def __init__(self, labels: list[str], **kwargs):
        super().__init__(**kwargs)
        self.rows = [(label, UNSET) for label in labels]
        self.styles.height = len(labels)

    def set_values(self, values: list[str]) -> None:
        rows = [(label, v) for (label, _), v in zip(self.rows, values)]
        if rows != self.rows:
            self.rows = rows
            self.refresh()

    def render(self) -> Text:
        width = self.size.width
        out = Text(no_wrap=True, overflow="ellipsis")
        for i, (label, value) in enumerate(self.rows):
            if i:
                out.append("\n")
            out.append(label, style="dim")
            out.append(" " * max(1, width - len(label) - len(value)) + value)
        return out


class MetricsPanel(VerticalScroll):
    """Model card, last reply's speed (with a sparkline of recent steps), engine state."""

    can_focus = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.card: ModelCard | None = None
        self.stats = Stats()
        self.figures: dict[str, str] = {}
        self.shown_card: ModelCard | None = None

    def compose(self) -> ComposeResult:
        yield Static("Model", classes="panel-title")
        yield Static(UNSET, id="model-card")
        yield Static("Last reply", classes="panel-title")
        yield Figures(["TTFT", "prefill", "decode", "tokens"], id="speed")
        yield Sparkline([], id="decode-spark")
        yield Figures(["bandwidth"], id="bandwidth")
        yield Static(id="peak")
        yield Static("Engine", classes="panel-title", id="engine-title")
        yield Figures(["KV used/free", "KV tokens", "prefix hit", "draft accept", "peak mem"], id="engine")

    def on_mount(self) -> None:
        self._show_figures()

    def set_model(self, card: ModelCard) -> None:
        self.card = card
        self._show_figures()

    def update_stats(self, stats: Stats) -> None:
        self.stats = stats
        self._show_figures()

    @staticmethod
    def _feature(enabled: bool | None, value: str) -> str:
        """n/a: the engine lacks the feature; off: switched off; else the measured value."""
        return NA if enabled is None else ("off" if not enabled else value)

    def _show_figures(self) -> None:
        c, s = self.card, self.stats
        f = self.figures
        if c is not None:
            f["model"] = c.name
            f["size"] = f"{fmt_params(c.num_params)} params, {fmt_bytes(c.weight_bytes)}"
            f["quantization"] = c.quantization
            f["context"] = f"{c.context_length} tok"
        # Sub-second TTFTs (a warm prefix, a small model on Metal) read better in ms.
        f["ttft"] = _num(s.ttft * 1000, ".0f", " ms") if s.ttft is not None and s.ttft < 1 else _num(s.ttft, ".2f", " s")
        f["prefill"] = "prompt cached" if s.prompt_cached else _num(s.prefill_tps, ".1f", " tok/s")
        f["decode"] = _num(s.decode_tps, ".1f", " tok/s")
        f["tokens"] = f"{s.prompt_tokens} in, {s.generated_tokens} out" if s.prompt_tokens else UNSET
        if c is not None and c.peak_gbps is None:
            f["bandwidth"] = NA
        else:
            f["bandwidth"] = _percent(s.bandwidth)
        f["peak"] = f"{c.peak_gbps:.1f} GB/s ({c.peak_source})" if c and c.peak_gbps else NA
        kv = s.kv
        f["kv_blocks"] = f"{kv.used_blocks} / {kv.free_blocks}" if kv else NA
        f["kv_tokens"] = str(kv.tokens_held) if kv else NA
        f["prefix_hit"] = self._feature(c.prefix_cache if c else None, _num(s.cached_tokens, "d", " tok"))
        f["acceptance"] = self._feature(c.speculation if c else None, _percent(s.acceptance))
        f["peak_memory"] = fmt_bytes(s.peak_memory)

        if self.shown_card is not c or not self.shown_card:
            self.shown_card = c  # the card changes on load only: these may re-wrap, so they take a layout pass
            if c is not None and c.server:
                self._show_remote(c)
            elif c is not None:
                self.query_one("#model-card", Static).update(Text.assemble(
                    (f["model"], "bold"), "\n", f["size"], "\n", f"{f['quantization']}, ctx {f['context']}",
                    "\n", f"attention: {c.attention}", *(["\n", f"draft: {c.drafter}"] if c.drafter else [])))
            self.query_one("#peak", Static).update(Text(f"of peak {f['peak']}", style="dim"))
        self.query_one("#speed", Figures).set_values([f["ttft"], f["prefill"], f["decode"], f["tokens"]])
        self.query_one("#decode-spark", Sparkline).data = list(s.step_tps)
        self.query_one("#bandwidth", Figures).set_values([f["bandwidth"]])
        self.query_one("#engine", Figures).set_values([
            f["kv_blocks"], f["kv_tokens"], f["prefix_hit"], f["acceptance"], f["peak_memory"]])

    def _show_remote(self, c: ModelCard) -> None:
        """A model on a server (`chat --url`): its name and context; the figures only the engine
        can measure (bandwidth, this process's KV and memory) give way to the server section."""
        ctx = ("\n", f"ctx {c.context_length} tok") if c.context_length else ()
        self.query_one("#model-card", Static).update(Text.assemble((c.name, "bold"), *ctx))
        for w in self.query("#bandwidth, #peak, #engine-title, #engine"):
            w.display = False
