"""Benchmark the engine across ranks: step time and communication per step at 1 and 2 ranks.

Side by side in one run (the dev machines are shared and noisy; docs/platform.md): the same
random-weight qwen2 model (float32 + OpenBLAS on a CPU host; ~70M parameters by default) is run

  1. in one process (the baseline; async scheduling off, as it is across ranks),
  2. under `mlx.launch -n 2 --backend ring` with --parallel tensor,
  3. the same with --parallel pipeline, each forward whole (--micro-batches 1),
  4. the same with the default micro-batches (one per rank when each gets 32 tokens: the prefill
     steps' two rows split, the decode steps' --batch rows of one token not),
  5. the same with every forward of several rows in 2 micro-batches (--micro-batches 2),

and each prints the median time of a prefill step (two requests' prompts of --chunk tokens) and
of a decode step at --batch rows, the host time rank 0 spends sending each forward's plan, and the time of a
decode forward's collectives as the engine measures them at run time (each rank replays the
collectives it recorded while building the forward, alone: macinfer.engine.collectives; the
slower rank's figure). The summary gives every figure as a ratio to the baseline.

Usage:
    python scripts/bench/distributed.py                       # ~3-5 min on 2 cores
    python scripts/bench/distributed.py --hidden 512 --layers 4 --steps 16
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import macinfer  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402

from macinfer.core.sampling import SamplingParams  # noqa: E402

REPLAYS = 6  # decode steps, after the timed ones, whose collectives every rank replays


def worker(args) -> None:
    """One rank (or the single process): time prefill and decode steps, then replay a few decode steps'
    collectives; rank 0 prints a JSON line."""
    from macinfer.llm import LLM

    group = mx.distributed.init()
    llm = LLM(args.model, parallel=args.parallel, micro_batches=args.micro_batches, engine="paged",
              max_num_seqs=args.batch, kv_memory="256MB", enable_prefix_cache=False, async_scheduling=False,
              max_num_batched_tokens=2 * args.chunk)
    engine, ranks = llm.engine, llm.ranks
    if ranks:
        ranks.replay_every = float("inf")  # no replays while steps are timed (but the first forward's)
    prefill, decode, plan, comm = [], [], [], []
    for i in range(args.batch):
        prompt = [(7 * i + j) % 300 + 3 for j in range(args.chunk)]
        engine.add_request(prompt, SamplingParams(max_tokens=args.steps + REPLAYS + args.batch + 3, ignore_eos=True))
    while engine.has_unfinished():
        decoding = all(s.num_uncomputed_tokens == 1 for s in engine.scheduler.running) and not engine.scheduler.waiting
        sent = ranks.comm_seconds if ranks else 0.0
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if not decoding or len(engine.scheduler.running) < args.batch:
            prefill.append(dt)
        elif len(decode) < args.steps:
            decode.append(dt)
            plan.append(ranks.comm_seconds - sent if ranks else 0.0)
        elif ranks:  # a step's replay is reported in the plan after the next one
            ranks.replay_every = 0.0
            comm.append(max(ranks.stats()["rank_comm_seconds"]))
    print(json.dumps({"ranks": group.size(), "parallel": ranks.parallel if ranks else "-",
                      "micro_batches": args.micro_batches or ("auto" if ranks and ranks.parallel == "pipeline" else 1),
                      "prefill_s": statistics.median(prefill), "decode_s": statistics.median(decode),
                      "plan_s": statistics.median(plan), "collectives_s": statistics.median(comm[2:]) if comm else 0.0,
                      "decode_steps": len(decode)}), flush=True)
    llm.close()


def run(args, ranks: int, parallel: str | None, micro_batches: int | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--hidden", str(args.hidden),
           "--layers", str(args.layers), "--batch", str(args.batch), "--chunk", str(args.chunk),
           "--steps", str(args.steps)] + (["--parallel", parallel] if parallel else [])
    cmd += ["--micro-batches", str(micro_batches)] if micro_batches else []
    if ranks > 1:
        cmd = [shutil.which("mlx.launch"), "-n", str(ranks), "--backend", "ring", "-p", str(args.port), "--"] + cmd
        args.port += 2
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("{")), None)
    if line is None:
        sys.exit(f"error: {' '.join(cmd[:8])} ... printed no result:\n{out.stderr[-1500:]}")
    return json.loads(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--parallel")
    p.add_argument("--micro-batches", type=int, help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="rows per decode step")
    p.add_argument("--chunk", type=int, default=64, help="prompt tokens per request (one prefill chunk)")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed")
    p.add_argument("--port", type=int, default=43100, help="first port for the ring backend")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if shutil.which("mlx.launch") is None:
        sys.exit("error: mlx.launch is not installed (it comes with mlx)")
    from tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        args.model = str(build_tiny_model(Path(tmp) / "m", "qwen2", hidden_size=args.hidden,
                                          num_layers=args.layers, heads=16, kv_heads=8))
        base = run(args, 1, None)
        rows = [base, run(args, 2, "tensor"), run(args, 2, "pipeline", 1), run(args, 2, "pipeline"),
                run(args, 2, "pipeline", 2)]
    print(f"float32 + OpenBLAS on this CPU (mlx {mx.__version__}, ring backend over localhost); "
          f"qwen2 hidden {args.hidden}, {args.layers} layers; decode at {args.batch} rows, prefill "
          f"{args.batch} x {args.chunk} tokens, two prompts a step")
    print(f"{'ranks':>5} {'split':>8} {'micro':>5} {'prefill step':>13} {'decode step':>12} {'plan send':>10} "
          f"{'collectives':>11}   (ratios: step time / 1 rank; plan and collectives / that run's decode step)")
    for r in rows:
        print(f"{r['ranks']:>5} {r['parallel']:>8} {r['micro_batches']:>5} {r['prefill_s'] / base['prefill_s']:>12.2f}x "
              f"{r['decode_s'] / base['decode_s']:>11.2f}x {r['plan_s'] / r['decode_s']:>9.0%} "
              f"{r['collectives_s'] / r['decode_s']:>10.0%}")


if __name__ == "__main__":
    main()
