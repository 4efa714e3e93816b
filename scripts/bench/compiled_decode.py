"""What compiling the decode forward buys (macinfer.core.decode_graph), one model, one process.

Two measurements, each repetition alternating the configurations so that a busy host disturbs
them alike (float32 weights + OpenBLAS on a CPU host: docs/platform.md):

  direct   the engine stepped by hand: 16 rows (64-token prompts) decoding 40 tokens; decode ms
           per step, compiled or eager on the worker thread, and eager with mx.async_eval
           (EngineConfig.compile_decode, eval_thread; compiling needs the worker thread);
  server   the path `macinfer bench` measures (AsyncEngine, asyncio clients): 16 concurrent
           requests, 64-token prompts, 32 new tokens; wall ms, compiled or eager.

Reported: medians over --reps. The model: `python scripts/bench/hybrid.py --save DIR --size tiny`.

Usage:
    python scripts/bench/compiled_decode.py DIR            # ~1 min on 2 idle cores (tiny model)
    python scripts/bench/compiled_decode.py DIR --reps 8 --rows 16
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import macinfer  # noqa: E402, F401  (OpenBLAS before MLX)
from macinfer.core.sampling import SamplingParams  # noqa: E402
from macinfer.engine.llm_engine import LLMEngine  # noqa: E402
from macinfer.llm import LLM  # noqa: E402
from macinfer.perf import bench  # noqa: E402

DIRECT = {"compiled, thread": dict(compile_decode=True), "eager, thread": dict(compile_decode=False),
          "eager, async_eval": dict(compile_decode=False, eval_thread=False)}


def direct_ms(engine: LLMEngine, rows: int, seed: int) -> float:
    """Decode ms per step of `rows` requests, after their prefill and two steps."""
    rng = random.Random(seed)
    for i in range(rows):
        engine.add_request([rng.randrange(3, 300) for _ in range(64)], SamplingParams(max_tokens=40, ignore_eos=True),
                           request_id=f"{seed}-{i}")
    for _ in range(4):
        engine.step()
    t, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (time.perf_counter() - t) / steps * 1e3


def server_ms(llm: LLM, rows: int, seed: int) -> float:
    backend = bench.InProcessBackend(llm)
    try:
        return bench.run_scenario(backend, bench.Scenario(rows, 64, "unique", 32), seed=seed).wall * 1e3
    finally:
        backend.close()
        llm.engine._async_engine = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="A model directory (scripts/bench/hybrid.py --save DIR --size tiny).")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--rows", type=int, default=16)
    args = ap.parse_args()
    print("float32 weights + OpenBLAS (CPU backend); medians of", args.reps, "alternating repetitions", flush=True)
    llms = {"compiled": LLM(args.model, compile_decode=True), "eager": LLM(args.model, compile_decode=False)}
    engines = {k: LLMEngine(llms["eager"].model, llms["eager"].tokenizer, None, max_num_seqs=args.rows, **kw)
               for k, kw in DIRECT.items()}
    direct = {k: [] for k in engines}
    server = {k: [] for k in llms}
    for rep in range(args.reps):
        for k, engine in engines.items():
            direct[k].append(direct_ms(engine, args.rows, rep))
        for k, llm in llms.items():
            server[k].append(server_ms(llm, args.rows, rep))
    for k, v in direct.items():
        print(f"direct  {k:<22} decode {statistics.median(v):6.2f} ms/step")
    for k, v in server.items():
        print(f"server  {k:<22} wall   {statistics.median(v):6.1f} ms")
    ratio = statistics.median(e / c for c, e in zip(server["compiled"], server["eager"]))
    print(f"server  eager / compiled wall: {ratio:.2f}x")


if __name__ == "__main__":
    main()
