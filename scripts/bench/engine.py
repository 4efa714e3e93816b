"""Benchmark the paged, continuously-batched engine against mlx-lm, side by side.

Every figure is a ratio to a baseline measured in the same run, runs of the two
sides interleaved (the dev machines are shared and noisy; docs/platform.md):

  1. single stream decode tok/s: macinfer vs mlx_lm.stream_generate, on a tiny
     model and on the embedded default (with and without async scheduling);
  2. aggregate throughput at 1/4/16/32 concurrent requests vs mlx-lm's
     BatchGenerator on the same prompts (float32 weights: on a CPU host batching
     only pays with float32 + OpenBLAS, see docs/platform.md);
  3. KV memory: bytes reserved vs bytes holding live tokens, and how many 2k-token
     sequences fit in a fixed budget vs allocating each request's maximum length;
  4. Python overhead per engine step at batch 32 with a stub model runner.

Usage:
    python scripts/bench/engine.py                 # everything (~5-10 min on 2 cores)
    python scripts/bench/engine.py --quick         # tiny model only
    python scripts/bench/engine.py --concurrency 1,4 --tokens 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import macinfer  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import BatchGenerator, stream_generate  # noqa: E402

from macinfer.engine.llm_engine import LLMEngine  # noqa: E402
from macinfer.core.sampling import SamplingParams  # noqa: E402

SENTENCES = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The capital of France is Paris, and the capital of Italy is",
    "Write a short poem about the moon rising over a quiet lake at night.",
    "In computer science, a hash table is a data structure that",
    "The quick brown fox jumps over the lazy dog while the farmer",
    "Explain in simple words why the sky looks blue during the day.",
    "My favourite recipe for a rainy Sunday afternoon starts with",
    "The history of the printing press begins in fifteenth century Europe, when",
]


def prompts_for(tok, n: int) -> list[list[int]]:
    """n distinct prompts of 13-20 tokens."""
    out = []
    for i in range(n):
        ids = tok.encode(f"{i}. " + SENTENCES[i % len(SENTENCES)])
        out.append(ids[:20])
    return out


# -- 1. single stream -----------------------------------------------------------------
def mlx_lm_decode_tps(model, tok, prompt, n) -> float:
    """mlx_lm.stream_generate (the issue's baseline: it detokenises and streams, as we do)."""
    stamps = []
    for _ in stream_generate(model, tok, prompt, max_tokens=n):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def engine_decode_tps(engine, prompt, n) -> float:
    engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    out = None
    while engine.has_unfinished():
        for d in engine.step():
            out = d.output or out
    return out.metrics.decode_tps


def bench_single(name, model, tok, info, n, reps) -> float:
    """mlx-lm vs the engine, with async scheduling (the default) and without, interleaved."""
    engine = LLMEngine(model, tok, info, kv_memory="256MB", max_model_len=2048)
    sync = LLMEngine(model, tok, info, kv_memory="256MB", max_model_len=2048, async_scheduling=False)
    prompt = prompts_for(tok, 1)[0]
    for e in (engine, sync):  # warm-up all three
        engine_decode_tps(e, prompt, 4)
    mlx_lm_decode_tps(model, tok, prompt, 4)
    a, b, c = [], [], []
    runs = [lambda: a.append(mlx_lm_decode_tps(model, tok, prompt, n)),
            lambda: b.append(engine_decode_tps(engine, prompt, n)),
            lambda: c.append(engine_decode_tps(sync, prompt, n))]
    for r in range(reps):  # rotate who goes first: the CPU's speed drifts over a run
        for run in runs[r % 3:] + runs[: r % 3]:
            run()
    ra, rb, rc = statistics.median(a), statistics.median(b), statistics.median(c)
    print(f"  {name:28s} mlx-lm {ra:8.1f} tok/s   macinfer {rb:8.1f} tok/s   ratio {rb / ra:5.2f}"
          f"   (without async scheduling {rc:8.1f} tok/s, {rc / ra:5.2f}; median of {reps}, {n} tokens)")
    return rb / ra


# -- 2. aggregate throughput -----------------------------------------------------------
def batchgen_throughput(model, prompts, n) -> float:
    gen = BatchGenerator(model, max_tokens=n, stop_tokens=None, completion_batch_size=max(32, len(prompts)))
    t0 = time.perf_counter()
    gen.insert(prompts, [n] * len(prompts))
    produced, done = 0, 0
    while done < len(prompts):
        for r in gen.next_generated():
            produced += 1
            done += r.finish_reason is not None
    dt = time.perf_counter() - t0
    gen.close()
    return produced / dt


def engine_throughput(engine, prompts, n) -> float:
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
    produced = 0
    while engine.has_unfinished():
        for d in engine.step():
            produced += len(d.token_ids)
    return produced / (time.perf_counter() - t0)


def bench_throughput(name, model, tok, info, n, levels, reps: int = 1) -> dict:
    """Medians over reps, the two sides alternating which goes first (this CPU speeds up and
    slows down over a run; whoever always ran second would be favoured)."""
    engine = LLMEngine(model, tok, info, kv_memory="512MB", max_model_len=2048, max_num_seqs=max(levels))
    print(f"  {name}: {engine.describe()}")
    engine_throughput(engine, prompts_for(tok, 2), 2)  # warm-up
    batchgen_throughput(model, prompts_for(tok, 2), 2)
    ratios = {}
    for c in levels:
        prompts = prompts_for(tok, c)
        a, b = [], []
        for r in range(reps):
            if r % 2:
                b.append(engine_throughput(engine, prompts, n))
                a.append(batchgen_throughput(model, prompts, n))
            else:
                a.append(batchgen_throughput(model, prompts, n))
                b.append(engine_throughput(engine, prompts, n))
        ma, mb = statistics.median(a), statistics.median(b)
        ratios[c] = mb / ma
        spread = f"  (ratios per rep {', '.join(f'{y / x:.2f}' for x, y in zip(a, b))})" if reps > 1 else ""
        print(f"  {c:3d} requests  BatchGenerator {ma:8.1f} tok/s   macinfer {mb:8.1f} tok/s   ratio {mb / ma:5.2f}{spread}")
    return ratios


# -- 3. KV memory -------------------------------------------------------------------------
def bench_memory(model, tok, context_len: int):
    """Waste = reserved - live over a mixed workload; capacity for 2k-token sequences."""
    import random

    rng = random.Random(0)
    # Block accounting does not depend on what the model computes: a stub runner
    # (every row samples token 7) makes this section take seconds, not minutes.
    engine = LLMEngine(model, tok, None, kv_memory="64MB", block_size=16, max_num_seqs=64,
                       max_num_batched_tokens=4096, max_model_len=context_len, async_scheduling=False)
    engine.runner = StubRunner()
    for _ in range(48):
        engine.add_request([rng.randrange(3, 300) for _ in range(rng.randrange(20, 600))],
                           SamplingParams(max_tokens=rng.randrange(8, 120), ignore_eos=True))
    reserved = live = peak_waste = 0
    while engine.has_unfinished():
        engine.step()
        s = engine.kv_stats()
        if s["reserved_bytes"]:
            reserved += s["reserved_bytes"]
            live += s["live_bytes"]
            peak_waste = max(peak_waste, 1 - s["live_bytes"] / s["reserved_bytes"])
    print(f"  mixed workload (48 requests, 20-600 prompt + 8-120 output tokens, block 16): "
          f"waste {100 * (1 - live / reserved):.2f}% of reserved bytes on average (worst step {100 * peak_waste:.1f}%)")

    # How many 2k-token sequences run at once in one fixed budget?
    budget = 64 << 20
    engine = LLMEngine(model, tok, None, kv_memory=budget, block_size=16, max_num_seqs=256,
                       max_num_batched_tokens=1 << 16, max_model_len=context_len, async_scheduling=False)
    engine.runner = StubRunner()
    for _ in range(200):
        engine.add_request([rng.randrange(3, 300) for _ in range(2000)], SamplingParams(max_tokens=48, ignore_eos=True))
    most = 0
    for _ in range(48):  # through the whole generation: preemption would show here
        engine.step()
        most = max(most, len(engine.scheduler.running))
    for rid in list(engine.requests):
        engine.abort_request(rid)
    engine.step()
    contiguous = budget // (context_len * engine.bytes_per_token)
    print(f"  2k-token sequences (2000 prompt + 48 output) in {budget >> 20} MiB: macinfer runs {most} at once; "
          f"contiguous max-length ({context_len} tokens each) fits {contiguous}: ratio {most / max(contiguous, 1):.1f}x")


# -- 4. Python overhead -------------------------------------------------------------------
class StubRunner:
    """Stands in for the model: returns token 7 for every sampling row, no MLX work.

    The engines using it run synchronously: async scheduling needs lazy MLX tokens.
    """

    kv_bytes = 0

    def execute_model(self, scheduled):
        return [7 if s.samples else None for s in scheduled]


def bench_overhead(model, tok, batch=32, steps=200):
    engine = LLMEngine(model, tok, None, num_blocks=4096, block_size=16, max_num_seqs=batch, async_scheduling=False)
    engine.runner = StubRunner()
    for i in range(batch):
        engine.add_request([5 + i] * 100, SamplingParams(max_tokens=steps + 10, ignore_eos=True))
    engine.step()  # prefills
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    per_step = (time.perf_counter() - t0) / steps
    # The runner's own host work (building inputs for the batch) on the real model.
    real = LLMEngine(model, tok, None, num_blocks=4096, block_size=16, max_num_seqs=batch)
    for i in range(batch):
        real.add_request([5 + i] * 100, SamplingParams(max_tokens=steps + 10, ignore_eos=True))
    real.step()
    sched = real.scheduler.schedule()
    t0 = time.perf_counter()
    for _ in range(50):
        real.runner.ctx.offsets = None
        real.runner.forward(sched.scheduled)  # graph only, never evaluated
    build = (time.perf_counter() - t0) / 50
    print(f"  engine step at batch {batch} with a stub runner (schedule + bookkeeping + detokenize): "
          f"{per_step * 1e3:.3f} ms/step")
    print(f"  + building the batch inputs and the lazy graph of a {len(model.layers)}-layer model: "
          f"{build * 1e3:.3f} ms/step")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model only")
    ap.add_argument("--tokens", type=int, default=24, help="generated tokens per request")
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per measurement (medians)")
    ap.add_argument("--skip-tiny", action="store_true", help="only the embedded model")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    levels = [int(x) for x in args.concurrency.split(",")]

    import mlx_lm

    from tiny import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-tiny-"))
    build_tiny_model(tmp, "llama", hidden_size=256, num_layers=4, heads=8, kv_heads=4, max_position_embeddings=8192)
    tiny, tiny_tok = mlx_lm.load(str(tmp))
    default = None
    if not args.quick:
        try:
            from macinfer.modelio.loader import load_model

            default = load_model(None, dequantize=True)  # float32 (see module docstring)
        except Exception as e:  # noqa: BLE001
            print(f"(embedded default unavailable: {e})")

    print(f"mlx {mx.__version__}, metal={mx.metal.is_available()}")
    print("\n1. Single stream decode (target ratio >= 1.0)")
    if not args.skip_tiny:
        bench_single("tiny llama (256 x 4 layers)", tiny, tiny_tok, None, 200, args.reps)
    if default:
        bench_single(f"{default[2].name} float32", *default, args.tokens, args.reps)

    print("\n2. Aggregate throughput, all requests at once (target >= 1.2x at 16)")
    if not args.skip_tiny:
        bench_throughput("tiny llama", tiny, tiny_tok, None, 64, levels, args.reps)
    if default:
        bench_throughput(f"{default[2].name} float32", *default, args.tokens, levels, args.reps)

    print("\n3. KV memory (target waste < 4%, >= 3x the sequences of contiguous allocation)")
    bench_memory(tiny, tiny_tok, context_len=8192)

    print("\n4. Python overhead per step")
    bench_overhead(default[0] if default else tiny, default[1] if default else tiny_tok)


if __name__ == "__main__":
    main()
