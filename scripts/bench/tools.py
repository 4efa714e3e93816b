"""What forced tool calls and thinking parsing cost: decode throughput at 16 concurrent, one run.

The embedded SmolLM2-135M (float32 weights + OpenBLAS on a CPU host: docs/platform.md), 16 chat
requests running together. Each repetition runs, the order rotating:

  tools    tool_choice "required" through macinfer.chat.prepare: SmolLM2's template has no tool
           calling, so the generic JSON format, every token sampled under the grammar's mask (the
           call's arguments held to the tool's schema, an unbounded `notes` string so the call
           runs to max_tokens)
  plain    the same conversations without tools, each request held to the token count its
           tools run produced (ignore_eos): identical model work, no grammar
  parsed   as plain, every delta fed to a `<think>` family's OutputParser (macinfer.chat.output:
           mlx-lm's TextStateMachine, the reply read as a thought), as `serve` does per choice

Reported: generated tokens per second of each (wall time from the first step to the last, the
prefill included, the same prompts in all) and the ratios tools/plain and parsed/plain, as medians
over --reps and as the best rep of each (on a busy shared host the least disturbed run); the
engine thread's CPU per token (the host work a grammar adds: masks, matchers; MLX evaluates the
forward on its worker thread, so this is an upper bound on what the grammar adds to a step's wall
time); and the parser's own time per token.

Usage:
    python scripts/bench/tools.py                  # ~5 min on 2 idle cores
    python scripts/bench/tools.py --reps 3 --max-tokens 64
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import macinfer  # noqa: E402,F401  (OpenBLAS before mlx)

from macinfer.chat.output import OutputParser  # noqa: E402
from macinfer.chat.reasoning import Thinking  # noqa: E402
from macinfer.chat.request import ChatRequest, prepare  # noqa: E402
from macinfer.core.sampling import SamplingParams  # noqa: E402
from macinfer.llm import LLM  # noqa: E402

TOOL = {"type": "function", "function": {
    "name": "plan_trip", "description": "Plan a trip",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "days": {"type": "integer", "minimum": 1, "maximum": 30},
        "budget": {"enum": ["low", "medium", "high"]},
        "notes": {"type": "string"}},
        "required": ["city", "days", "budget", "notes"], "additionalProperties": False}}}
CITIES = ["Lyon", "Oslo", "Kyoto", "Nairobi", "Lima", "Porto", "Austin", "Vienna"]
THINK = Thinking("think", "<think>", "</think>")


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], parsers=None):
    """(wall seconds, the engine thread's CPU seconds, generated tokens per request, seconds inside the
    parsers), every request at once."""
    engine = llm.engine
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    by_id = dict(zip(rids, parsers)) if parsers else {}
    counts, parse_s, host = {}, 0.0, 0.0
    start = time.perf_counter()
    while engine.has_unfinished():
        t = time.thread_time()
        deltas = engine.step()
        host += time.thread_time() - t
        for d in deltas:
            if by_id:
                t = time.perf_counter()
                by_id[d.request_id].feed(d)
                parse_s += time.perf_counter() - t
            if d.output is not None:
                counts[d.request_id] = len(d.output.token_ids)
    return time.perf_counter() - start, host, [counts[r] for r in rids], parse_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    llm = LLM(max_num_seqs=args.concurrency, dequantize=True)  # the embedded model, float32
    tok = llm.tokenizer
    n = args.concurrency
    messages = [[{"role": "user", "content": f"Plan a trip to {CITIES[i % len(CITIES)]} (#{i}) with plan_trip."}]
                for i in range(n)]
    tools = [prepare(tok, ChatRequest(m, tools=[TOOL], tool_choice="required"),
                     SamplingParams(temperature=0.7, seed=i, max_tokens=args.max_tokens)) for i, m in enumerate(messages)]
    plain_prompts = [prepare(tok, ChatRequest(m)).prompt_ids for m in messages]
    run(llm, [t.prompt_ids for t in tools[:2]], [dataclasses.replace(t.params, max_tokens=4) for t in tools[:2]])
    print(f"{llm.info.name} ({llm.info.quantization}; BLAS: {macinfer._blas.loaded or 'bundled'}), "
          f"{n} concurrent, up to {args.max_tokens} tokens each, {args.reps} reps")

    rates = {"tools": [], "plain": [], "parsed": []}
    host_ms = {"tools": [], "plain": [], "parsed": []}
    parse_us = []
    for rep in range(args.reps):
        order = ["tools", "plain", "parsed"]
        order = order[rep % 3:] + order[:rep % 3] if rep else order  # tools first once: plain needs its counts
        for kind in order:
            if kind == "tools":
                wall, cpu, counts, _ = run(llm, [t.prompt_ids for t in tools], [t.params for t in tools])
                held = counts
            else:
                params = [SamplingParams(temperature=0.7, seed=i, max_tokens=held[i], ignore_eos=True) for i in range(n)]
                parsers = [OutputParser(tok, THINK, True, None, None) for _ in range(n)] if kind == "parsed" else None
                wall, cpu, counts, parse_s = run(llm, plain_prompts, params, parsers)
                if parsers:
                    parse_us.append(1e6 * parse_s / sum(counts))
            rates[kind].append(sum(counts) / wall)
            host_ms[kind].append(1000 * cpu / sum(counts))
            print(f"  rep {rep} {kind:6s} {sum(counts):5d} tok in {wall:6.2f} s: {sum(counts) / wall:6.1f} tok/s, "
                  f"engine thread {1000 * cpu / sum(counts):5.2f} ms CPU / tok", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    best = {k: max(v) for k, v in rates.items()}
    host = {k: statistics.median(v) for k, v in host_ms.items()}
    print(f"decode tok/s, median (best): " + ", ".join(f"{k} {med[k]:.1f} ({best[k]:.1f})" for k in med))
    print(f"tools / plain  = {med['tools'] / med['plain']:.3f} median, {best['tools'] / best['plain']:.3f} best   "
          "(grammar-forced tool calls vs free text)")
    print(f"parsed / plain = {med['parsed'] / med['plain']:.3f} median, {best['parsed'] / best['plain']:.3f} best   "
          f"(thinking parser on every delta vs none); the parser: {statistics.median(parse_us):.1f} us per token")
    per_tok = 1000 / best["plain"]  # ms of wall per token in the least disturbed plain run
    print(f"engine thread ms CPU / tok (median): " + ", ".join(f"{k} {v:.2f}" for k, v in host.items())
          + f"; the grammar adds at most {host['tools'] - host['plain']:.2f} ms per token = "
          f"{100 * (host['tools'] - host['plain']) / per_tok:.1f}% of the best plain run's {per_tok:.1f} ms per token")


if __name__ == "__main__":
    main()
