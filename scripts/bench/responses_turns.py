"""What `previous_response_id` is worth: a Responses conversation's second turn with the prefix
cache (its first turn's KV reused) vs without it, side by side in one run.

The embedded SmolLM2-135M behind two servers, one with the prefix cache and one without. Each
repetition (the order alternating) sends a first turn (a ~1,900-token document and a question,
its own per repetition) to both, then the second turn (`previous_response_id` and a short
question, one token of answer) and times that second request: with the cache it prefills only
what the first turn did not cover; without it, the whole conversation.

Reported: the second turn's wall time on each (median over --reps), the ratio off / on, and the
prompt and cached tokens the second turn's usage reports.

Usage:
    python scripts/bench/responses_turns.py            # ~2 min on 2 idle cores
    python scripts/bench/responses_turns.py --reps 5
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import macinfer  # noqa: E402,F401  (OpenBLAS before mlx)

import openai  # noqa: E402

from macinfer.llm import LLM  # noqa: E402
from macinfer.serve.server import create_app, serve_in_thread  # noqa: E402

DOCUMENT = (ROOT / "docs" / "server.md").read_text()[:6000]


def second_turn(url: str, rep: int) -> tuple[float, int, int]:
    """(seconds, prompt tokens, cached tokens) of a conversation's second turn."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=600)
    first = c.responses.create(model="m", input=f"({rep}) Read this and answer briefly.\n\n{DOCUMENT}",
                               max_output_tokens=8, temperature=0)
    t = time.perf_counter()
    second = c.responses.create(model="m", previous_response_id=first.id, input="What is the default port?",
                                max_output_tokens=1, temperature=0)
    return time.perf_counter() - t, second.usage.input_tokens, second.usage.input_tokens_details.cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(serve_in_thread(create_app(LLM(enable_prefix_cache=cache), model_name="m")))
                for name, cache in (("cache", True), ("no cache", False))}
        runs: dict[str, list] = {name: [] for name in urls}
        for rep in range(args.reps):
            for name in (list(urls) if rep % 2 == 0 else list(urls)[::-1]):
                runs[name].append(second_turn(urls[name], rep))
    for name, rows in runs.items():
        seconds = statistics.median(r[0] for r in rows)
        print(f"{name:9s} second turn {seconds:7.3f} s (median of {len(rows)}); prompt {rows[-1][1]} tokens, "
              f"{rows[-1][2]} from the prefix cache; each: {', '.join(f'{r[0]:.2f}' for r in rows)}")
    ratio = statistics.median(r[0] for r in runs["no cache"]) / statistics.median(r[0] for r in runs["cache"])
    print(f"no cache / cache: {ratio:.1f}x")


if __name__ == "__main__":
    main()
