"""What structured output costs: throughput at 16 concurrent with vs without a JSON schema, one run.

The embedded SmolLM2-135M (float32 weights + OpenBLAS on a CPU host: docs/platform.md), 48
chat requests asking for a JSON object, at most 16 running at once (the scheduler admits the
next as one finishes). Each repetition runs these, the order rotating:

  schema   response_format-style json_schema: each token sampled under the grammar's mask,
           pipelined like free text (a grammar row is sampled once the step before is read
           back, while the next forward runs: macinfer.engine.pipeline);
  free     the same prompts and seeds, no schema, each request held to the token count its
           schema run produced (ignore_eos), so both do identical model work; pipelined
           (async scheduling), as free text runs by default;
  free-sync  as free, with async scheduling off: what pipelining is worth here.

Reported: tokens per second of each (generated tokens / wall time of the run, prefill included,
the same prompts in all three) and the ratios to `free`, medians over --reps; and CPU seconds
(all threads) per 1000 tokens, which a busy shared host disturbs less than wall time.

Usage:
    python scripts/bench/structured.py             # ~10 min on 2 idle cores
    python scripts/bench/structured.py --reps 3 --requests 16 --max-tokens 48
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import macinfer  # noqa: E402,F401  (OpenBLAS before mlx)

from macinfer.core.grammar import StructuredOutput  # noqa: E402
from macinfer.core.sampling import SamplingParams  # noqa: E402
from macinfer.llm import LLM  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "city", "age", "role", "tags"],
    "additionalProperties": False,
}
TOPICS = ["a chef in Lyon", "a pilot from Oslo", "a student in Kyoto", "a farmer near Nairobi",
          "a nurse in Lima", "a painter from Porto", "a coder in Austin", "a baker in Vienna"]


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, float, list[int]]:
    """Wall and CPU seconds (every thread) to finish every request, and each one's generated token count."""
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, time.process_time() - c0, [len(o.token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    llm = LLM(max_num_seqs=args.concurrency)  # the embedded model; float32 where there is no Metal
    engine = llm.engine
    prompts = [llm.apply_chat_template([{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} (#{i}) "
                                         "as a JSON object with name, city, age, role and tags."}])
               for i in range(args.requests)]
    structured = StructuredOutput(json_schema=SCHEMA)
    run(llm, prompts[:2], SamplingParams(max_tokens=4, structured=structured))  # warm: llguidance's tokenizer
    print(f"{llm.info.name} ({llm.info.quantization}; BLAS: {macinfer._blas.loaded or 'bundled'}), "
          f"{args.requests} requests, {args.concurrency} at once, temperature 0.7; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

    seeds = list(range(args.requests))
    schema_params = [SamplingParams(temperature=0.7, seed=s, max_tokens=args.max_tokens, structured=structured)
                     for s in seeds]
    tps: dict[str, list[float]] = {"schema": [], "free": [], "free-sync": []}
    cpu: dict[str, list[float]] = {n: [] for n in tps}  # CPU seconds per 1000 tokens
    lengths = None
    for rep in range(args.reps):
        # The schema run comes first once (its token counts define the free runs), then the order rotates.
        names = ["schema", "free", "free-sync"]
        names = names[rep % 3:] + names[: rep % 3] if rep else names
        for name in names:
            if name == "schema":
                t, c, got = run(llm, prompts, schema_params)
                lengths = lengths or got
            else:
                engine.config.async_scheduling = name == "free"
                t, c, got = run(llm, prompts, [SamplingParams(temperature=0.7, seed=s, max_tokens=n, ignore_eos=True)
                                            for s, n in zip(seeds, lengths)])
                engine.config.async_scheduling = True
            assert got == lengths, "every run must generate the same tokens counts (seeded sampling)"
            tps[name].append(sum(lengths) / t)
            cpu[name].append(1000 * c / sum(lengths))
        print(f"rep {rep}: {sum(lengths)} tokens (mean {sum(lengths) / len(lengths):.0f} per request); "
              + ", ".join(f"{n} {v[-1]:.1f} tok/s" for n, v in tps.items()))
    med = {n: statistics.median(v) for n, v in tps.items()}
    mcpu = {n: statistics.median(v) for n, v in cpu.items()}
    print("median tok/s: " + ", ".join(f"{n} {v:.1f}" for n, v in med.items()))
    print("median CPU s per 1000 tokens: " + ", ".join(f"{n} {v:.1f}" for n, v in mcpu.items())
          + f"; schema / free: {mcpu['schema'] / mcpu['free']:.3f}")
    print(f"schema / free: {med['schema'] / med['free']:.3f}  (cost {100 * (1 - med['schema'] / med['free']):.1f}%); "
          f"schema / free-sync: {med['schema'] / med['free-sync']:.3f}; free-sync / free: "
          f"{med['free-sync'] / med['free']:.3f}; load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
