"""The TUI's own cost: decode tok/s inside `macinfer chat` vs the bare engine, same prompt.

    python -m tui.overhead [MODEL] [-n 64] [--rounds 5]

Each round runs the prompt (greedy, so the same tokens) through `LLM.stream`, as
`macinfer run` does, then through a headless ChatApp (engine thread, Messages,
Markdown streaming, metrics panel) on the same model, alternating so machine
noise hits both alike. (The app loads its own copy on its engine thread: MLX
streams are per thread, so a model is used on the thread that loaded it.) Prints both rates and the ratio per round, then
the median ratio. Headless skips writing to a real terminal; the rest of the
UI's work is all there.
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


async def in_tui(model: str | None, max_tokens: int) -> float:
    from tui.app import ChatApp

    app = ChatApp(model, max_tokens=max_tokens, peak_bandwidth=100)
    async with app.run_test(size=(100, 30)) as pilot:
        while app.chat.model_name is None:
            await pilot.pause(0.05)
        app.chat.query_one("#prompt").set_text(PROMPT)
        await pilot.press("enter")
        await pilot.pause(0.1)
        while app.chat.request_id is not None:
            await pilot.pause(0.05)
        return app.runner.last_stats.decode_tps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
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
    print(f"median TUI/run decode ratio: {statistics.median(ratios):.3f} over {a.rounds} rounds")


if __name__ == "__main__":
    main()
