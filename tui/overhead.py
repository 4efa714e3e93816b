"""The TUI's own cost: decode tok/s inside `macinfer chat` vs the bare engine, same prompt.

    python -m tui.overhead [MODEL] [-n 64] [--rounds 5]
    python -m tui.overhead --stub-rate 300 [-n 600] [--rounds 5]

Model mode: each round runs the prompt (greedy, so the same tokens) through
`LLM.stream`, as `macinfer run` does, then through a headless ChatApp (engine
thread, Messages, Markdown streaming, metrics panel) on the same model, alternating
so machine noise hits both alike. (The app loads its own copy on its engine thread:
MLX streams are per thread, so a model is used on the thread that loaded it.)

Stub mode (--stub-rate N): no model. tui.stub.StubBackend streams Markdown at N tok/s
(each step sleeps 1/N s with the GIL released, as an MLX eval does) through the real
runner, Messages and widgets. The bare rate is the same stub stepped in a plain loop;
in the app, "engine" is the rate the stub kept up while the UI ran, and "UI" the rate
the UI finished at: tokens after the first / (reply text complete on screen - first
token). The ratio is UI / bare, so a UI that lags behind the engine counts too.

Prints both rates and the ratio per round, then the median ratio. Headless skips
writing to a real terminal; the rest of the UI's work (layout, Markdown, rendering
the screen's lines) is all there.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import macinfer  # noqa: F401  (OpenBLAS before MLX)

PROMPT = "Write a short poem about the sea."


def bare(llm, ids, params) -> float:
    out = None
    for d in llm.stream(ids, params):
        out = d.output or out
    return out.metrics.decode_tps


async def reply_in(app, timeout: float) -> tuple[float, object]:
    """Send PROMPT in a headless `app`: (when its reply was complete on screen, the Reply widget).

    It waits on the reply's own `finish`, not by polling: a Pilot.pause visits every
    widget, work that the app alone would not do.
    """
    from tui.widgets.transcript import Reply

    done = asyncio.Event()
    finished: list = []
    real_finish = Reply.finish

    async def finish(self):  # the reply's whole text is in the Markdown widget when this returns
        text = await real_finish(self)
        finished.append((time.perf_counter(), self))
        done.set()
        return text

    Reply.finish = finish
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            while app.chat.model_name is None or app.chat.loading_what is not None:
                await pilot.pause(0.05)
            app.chat.query_one("#prompt").set_text(PROMPT)
            await pilot.press("enter")
            await asyncio.wait_for(done.wait(), timeout)
            return finished[0]
    finally:
        Reply.finish = real_finish


async def in_tui(model: str | None, max_tokens: int) -> float:
    from tui.app import ChatApp

    app = ChatApp(model, max_tokens=max_tokens, peak_bandwidth=100)
    await reply_in(app, timeout=3600)
    return app.runner.last_stats.decode_tps


# -- stub mode ------------------------------------------------------------------------
class _Params:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens


def bare_stub(rate: float, n: int) -> float:
    """The stub stepped as `LLM.stream` steps an engine: no UI."""
    from tui.stub import StubBackend

    b = StubBackend(rate=rate)
    b.add_request(list(range(8)), _Params(n), "bare")
    out = None
    while b.has_unfinished():
        for d in b.step():
            out = d.output or out
    return out.metrics.decode_tps


async def in_tui_stub(rate: float, n: int) -> tuple[float, float, int]:
    """(engine tok/s, UI tok/s, Markdown updates) of one reply in a headless ChatApp."""
    from tui.app import ChatApp
    from tui.stub import StubBackend

    backends: list[StubBackend] = []

    def make(spec):
        backends.append(StubBackend(spec, rate=rate))
        return backends[-1]

    app = ChatApp(max_tokens=n, make_backend=make)
    finished_at, reply = await reply_in(app, timeout=60 + 4 * n / rate)
    m = app.runner.last_stats
    return m.decode_tps, (m.generated_tokens - 1) / (finished_at - backends[-1].first_token_time), reply.updates


def main_stub(rate: float, n: int, rounds: int) -> None:
    import macinfer.core.sampling  # noqa: F401  (MLX, mlx-lm: imported by a real backend's load, before the app freezes the heap)

    bare_stub(rate, 8)  # warm-up
    ratios = []
    print(f"stub engine at {rate:g} tok/s, {n} tok per reply")
    for r in range(rounds):
        base = bare_stub(rate, n)
        engine, ui, updates = asyncio.run(in_tui_stub(rate, n))
        ratios.append(ui / base)
        print(f"round {r + 1}: bare {base:7.1f} tok/s | TUI engine {engine:7.1f} tok/s ({engine / base:.3f}) | "
              f"UI {ui:7.1f} tok/s | {updates} Markdown updates | UI/bare {ui / base:.3f}")
    print(f"stub {rate:g} tok/s: median UI/bare ratio over {rounds} rounds: median {statistics.median(ratios):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("-n", "--max-tokens", type=int, default=None, help="tokens per reply (64; stub: 600)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stub-rate", type=float, default=None, metavar="TOK_S",
                    help="no model: a stub engine streaming at this many tok/s")
    a = ap.parse_args()
    if a.stub_rate is not None:
        main_stub(a.stub_rate, a.max_tokens or 600, a.rounds)
        return
    a.max_tokens = a.max_tokens or 64
    from macinfer.llm import LLM
    from macinfer.core.sampling import SamplingParams

    llm = LLM(a.model)
    ids = llm.apply_chat_template([{"role": "user", "content": PROMPT}])
    params = SamplingParams(max_tokens=a.max_tokens)
    bare(llm, ids, SamplingParams(max_tokens=4))  # warm-up
    ratios = []
    print(f"model {llm.info.name}, prompt {len(ids)} tok, {a.max_tokens} tok generated (greedy)")
    for r in range(a.rounds):
        t0 = time.perf_counter()
        base = bare(llm, ids, params)
        tui = asyncio.run(in_tui(a.model, a.max_tokens))
        ratios.append(tui / base)
        print(f"round {r + 1}: macinfer run path {base:7.1f} tok/s | TUI {tui:7.1f} tok/s | "
              f"TUI/run {tui / base:.3f}  ({time.perf_counter() - t0:.0f} s)")
    print(f"median TUI/run decode ratio: {statistics.median(ratios):.3f} over {a.rounds} rounds, "
          f"median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
