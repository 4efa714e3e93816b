#!/usr/bin/env python3
"""`macinfer run` vs `mlx_lm.stream_generate`, and prefill with vs without OpenBLAS.

One run, side by side, medians of --repeats. Both engines get the very same model
object (loaded by macinfer: on hosts without Metal its half-precision params are
cast to float32, which mlx-lm would otherwise run ~40x slower), so the ratio
measures the engines, not the loaders.

Prefill with/without OpenBLAS runs in subprocesses, since BLAS is chosen at
process start (MACINFER_NO_OPENBLAS=1 keeps the bundled reference BLAS).

Usage: python scripts/bench/run.py [--model smollm2-135m] [--repeats 3] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = "What is the capital of France? Answer in one sentence, then name two famous landmarks there."


def bench_engines(model_spec, repeats, tokens, dequantize):
    import macinfer  # noqa: F401  (OpenBLAS before mlx)
    from mlx_lm.generate import stream_generate

    from macinfer.llm import LLM
    from macinfer.core.sampling import SamplingParams

    # Prefix cache off: repeats of one prompt would otherwise be cache hits (not what is compared).
    llm = LLM(model_spec, dequantize=dequantize, enable_prefix_cache=False)
    ids = llm.apply_chat_template([{"role": "user", "content": PROMPT}])
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    # Warm-up (the first forward of a process is slower): not measured.
    llm.generate([ids], SamplingParams(max_tokens=2))
    rows = {"macinfer": [], "mlx-lm": []}
    for _ in range(repeats):
        out = llm.generate([ids], params)[0]
        rows["macinfer"].append((out.metrics.ttft, out.metrics.decode_tps))
        t0 = time.perf_counter()
        ttft = None
        n = 0
        for r in stream_generate(llm.model, llm.tokenizer, ids, max_tokens=tokens):
            n += 1
            if ttft is None:
                ttft = time.perf_counter() - t0
                t1 = time.perf_counter()
        rows["mlx-lm"].append((ttft, (n - 1) / (time.perf_counter() - t1)))
    med = {k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v)) for k, v in rows.items()}
    return len(ids), llm.info, med


def prefill_child(model_spec, n_tokens, dequantize):
    """Runs in a subprocess: prefill tok/s of one n-token prompt (best of 2)."""
    import macinfer  # noqa: F401
    import mlx.core as mx

    from macinfer import _blas
    from macinfer.modelio.loader import load_model

    model, tok, _ = load_model(model_spec, dequantize=dequantize)
    ids = (tok.encode("The history of Paris is long and rich. " * 200))[:n_tokens]
    best = float("inf")
    for _ in range(2):
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        t = time.perf_counter()
        mx.eval(model(mx.array([ids]), cache=cache))
        best = min(best, time.perf_counter() - t)
    print(json.dumps({"blas": _blas.loaded or "bundled", "tps": n_tokens / best}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=128)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        prefill_child(a.child[0] if a.child[0] != "-" else None, int(a.child[1]), a.child[2] == "1")
        return

    print("== macinfer run vs mlx_lm.stream_generate (same model object, greedy, medians)")
    for deq in (False, True):
        n, info, med = bench_engines(a.model, a.repeats, a.tokens, deq)
        (t_m, d_m), (t_l, d_l) = med["macinfer"], med["mlx-lm"]
        print(f"[{info.quantization}] prompt {n} tok, {a.tokens} new tokens")
        print(f"  TTFT      macinfer {t_m:.3f} s   mlx-lm {t_l:.3f} s   ratio (mlx-lm/macinfer) {t_l / t_m:.2f}x")
        print(f"  decode    macinfer {d_m:.1f} tok/s   mlx-lm {d_l:.1f} tok/s   ratio {d_m / d_l:.2f}x")

    print(f"== prefill tok/s of a {a.prefill_tokens}-token prompt, OpenBLAS vs bundled BLAS")
    for deq in ("0", "1"):
        res = {}
        for no_blas in ("0", "1"):
            env = dict(os.environ, MACINFER_NO_OPENBLAS=no_blas)
            out = subprocess.run([sys.executable, __file__, "--child", a.model or "-", str(a.prefill_tokens), deq],
                                 env=env, capture_output=True, text=True)
            if out.returncode:
                print(out.stderr[-2000:])
                sys.exit(1)
            res[no_blas] = json.loads(out.stdout.strip().splitlines()[-1])
        label = "float32 (dequantised)" if deq == "1" else "as stored (quantised)"
        print(f"  {label:24s} OpenBLAS {res['0']['tps']:.1f} tok/s   bundled {res['1']['tps']:.1f} tok/s   "
              f"ratio {res['0']['tps'] / res['1']['tps']:.2f}x   [{res['0']['blas']}]")


if __name__ == "__main__":
    main()
