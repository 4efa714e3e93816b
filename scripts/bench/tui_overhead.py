"""The TUI's own cost: decode tok/s inside `macinfer chat` vs the bare engine, same prompt.

    python scripts/bench/tui_overhead.py [MODEL] [-n 64] [--rounds 5]
    python scripts/bench/tui_overhead.py --stub-rate 300 [-n 600] [--rounds 5]

Model mode: each round runs the prompt (greedy, so the same tokens) through
`LLM.stream`, as `macinfer run` does, then through a headless ChatApp (engine
process, Messages, Markdown streaming, metrics panel) on the same model, alternating
so machine noise hits both alike. (The app's engine process loads its own copy and, like
the bare engine, answers a 4-token warm-up first.)

Stub mode (--stub-rate N): no model. macinfer.tui.stub.StubBackend streams Markdown at N tok/s
(each step sleeps 1/N s, as a step waits on an MLX eval) through the real engine
process, runner, Messages and widgets. The bare rate is the same stub stepped in a
plain loop; in the app, "engine" is the rate the stub kept up while the UI ran, and
"UI" the rate the UI finished at: tokens after the first / (reply text complete on
screen - first token). The ratio is UI / bare, so a UI that lags behind the engine
counts too. (The first token is stamped in the engine process: time.perf_counter is
the system-wide monotonic clock on Linux and macOS, so the two processes' readings
compare.)

The engine runs in its own process (macinfer.tui.engine_process) because on a thread it
shared the UI's GIL, and the UI's layout and Markdown work delayed its every step.
What is left between the two is CPU on a machine with few cores and the pipe: each
write wakes the UI's reader thread mid-step (so the engine batches what it posts, at
most every macinfer.tui.runner.TEXT_INTERVAL), and each Markdown append costs the UI a layout
(so the reply shows new text in a plain tail and appends complete blocks at most every
Reply.LAYOUT_INTERVAL). The UI rate also counts the reply's last append, which the
user waits for after the last token.

Prints both rates and the ratio per round, then the median ratio. Headless skips
writing to a real terminal; the rest of the UI's work (layout, Markdown, rendering
the screen's lines) is all there.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from functools import partial
from operator import attrgetter

import macinfer  # noqa: F401  (OpenBLAS before MLX)

PROMPT = "Write a short poem about the sea."


def bare(llm, ids, params) -> float:
    out = None
    for d in llm.stream(ids, params):
        out = d.output or out
    return out.metrics.decode_tps


async def reply_in(app, timeout: float, probe=None, warm_up: bool = False) -> tuple[float, object, object, object]:
    """Send PROMPT in a headless `app`: (when its reply was complete on screen, the Reply widget,
    the reply's Stats, probe(backend) run in the engine process afterwards).

    warm_up: first a 4-token reply, out of the history, as `bare` has (the engine process
    is new each round: its first forwards would otherwise count its warm-up).

    It waits on the reply's own `finish`, not by polling: a Pilot.pause visits every
    widget, work that the app alone would not do.
    """
    from macinfer.tui.widgets import MetricsPanel
    from macinfer.tui.widgets.transcript import Reply

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
            for max_tokens in ([4] if warm_up else []) + [app.session.max_tokens]:
                app.session.clear()
                app.session.max_tokens = max_tokens
                finished.clear()
                done.clear()
                app.chat.query_one("#prompt").set_text(PROMPT)
                await pilot.press("enter")
                await asyncio.wait_for(done.wait(), timeout)
                while app.chat.request_id is not None:  # the rest of the ReplyFinished handler
                    await pilot.pause()
            probed = await asyncio.wrap_future(app.engine.call(probe)) if probe else None
            return (*finished[0], app.chat.query_one(MetricsPanel).stats, probed)
    finally:
        Reply.finish = real_finish


async def in_tui(model: str | None, max_tokens: int) -> float:
    from macinfer.tui.app import ChatApp

    app = ChatApp(model, max_tokens=max_tokens, peak_bandwidth=100)
    _, _, stats, _ = await reply_in(app, timeout=3600, warm_up=True)
    return stats.decode_tps


# -- stub mode ------------------------------------------------------------------------
def bare_stub(rate: float, n: int) -> float:
    """The stub stepped as `LLM.stream` steps an engine: no UI."""
    from macinfer.core.sampling_params import SamplingParams
    from macinfer.tui.stub import StubBackend

    b = StubBackend(rate=rate)
    b.add_request(list(range(8)), SamplingParams(max_tokens=n), "bare")
    out = None
    while b.has_unfinished():
        for d in b.step():
            out = d.output or out
    return out.metrics.decode_tps


async def in_tui_stub(rate: float, n: int) -> tuple[float, float, object]:
    """(engine tok/s, UI tok/s, the Reply widget: its Markdown appends and tail repaints) of one reply
    in a headless ChatApp."""
    from macinfer.tui.app import ChatApp
    from macinfer.tui.stub import StubBackend

    app = ChatApp(max_tokens=n, make_backend=partial(StubBackend, rate=rate))
    finished_at, reply, m, first_token = await reply_in(app, timeout=60 + 4 * n / rate,
                                                        probe=attrgetter("first_token_time"))
    return m.decode_tps, (m.generated_tokens - 1) / (finished_at - first_token), reply


def main_stub(rate: float, n: int, rounds: int) -> None:
    bare_stub(rate, 8)  # warm-up
    ratios = []
    print(f"stub engine at {rate:g} tok/s, {n} tok per reply")
    for r in range(rounds):
        base = bare_stub(rate, n)
        engine, ui, reply = asyncio.run(in_tui_stub(rate, n))
        ratios.append(ui / base)
        print(f"round {r + 1}: bare {base:7.1f} tok/s | TUI engine {engine:7.1f} tok/s ({engine / base:.3f}) | "
              f"UI {ui:7.1f} tok/s | {reply.updates} Markdown appends, {reply.repaints} tail repaints | "
              f"UI/bare {ui / base:.3f}")
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
