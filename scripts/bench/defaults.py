#!/usr/bin/env python3
"""`macinfer run` as a user runs it: the default load vs `--dequantize` (and `--keep-quantized`).

The default must not be the slow path: on a host without Metal it should load quantised weights
as float, so its decode rate should be close to `--dequantize`'s. Each configuration runs in its
own process as `macinfer run` does (LLM(dequantize=None / True / False): load, one greedy request
of --tokens, prefix cache off so that repeats are not cache hits), interleaved round by round so
that load on a shared machine hits them alike; medians are compared as ratios to `--dequantize`.

Usage: python scripts/bench/defaults.py [--model smollm2-135m] [--repeats 3] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys

PROMPT = "What is the capital of France? Answer in one sentence, then name two famous landmarks there."
CONFIGS = {"default": None, "--dequantize": True, "--keep-quantized": False}  # LLM(dequantize=...) as `run` passes it


def child(model: str | None, tokens: int, dequantize: bool | None) -> None:
    """In its own process, as `macinfer run` does it: load, one greedy request; prints its metrics."""
    from macinfer.core.sampling import SamplingParams
    from macinfer.llm import LLM

    llm = LLM(model, dequantize=dequantize, enable_prefix_cache=False)
    ids = llm.apply_chat_template([{"role": "user", "content": PROMPT}])
    m = llm.generate([ids], SamplingParams(max_tokens=tokens, ignore_eos=True))[0].metrics
    print(json.dumps({"decode_tps": m.decode_tps, "ttft_s": m.ttft, "quantization": llm.info.quantization}))


def run_once(model: str | None, tokens: int, dequantize: bool | None) -> dict:
    argv = [sys.executable, __file__, "--child", model or "-", str(tokens), json.dumps(dequantize)]
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{' '.join(argv)} failed: {out.stderr.strip()[-1000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="MODEL as `macinfer run` takes it (default: the embedded one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(None if a.child[0] == "-" else a.child[0], int(a.child[1]), json.loads(a.child[2]))
        return
    run_once(a.model, 2, None)  # a first-time GGUF conversion is not measured
    rows: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for _ in range(a.repeats):
        for name, flags in CONFIGS.items():
            rows[name].append(run_once(a.model, a.tokens, flags))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("decode_tps", "ttft_s")} for name, rs in rows.items()}
    base = med["--dequantize"]
    print(f"== macinfer run {a.model or '(embedded model)'}: {a.tokens} tokens, medians of {a.repeats}, "
          f"interleaved; {platform.machine()} {'Metal' if _metal() else 'CPU backend, float32 + OpenBLAS'}")
    for name in CONFIGS:
        m = med[name]
        print(f"  {name:16s} [{rows[name][0]['quantization']}] decode {m['decode_tps']:6.1f} tok/s ({m['decode_tps'] / base['decode_tps']:.2f}x of "
              f"--dequantize)   TTFT {m['ttft_s']:.3f} s ({m['ttft_s'] / base['ttft_s']:.2f}x)")


def _metal() -> bool:
    import mlx.core as mx

    return mx.metal.is_available()


if __name__ == "__main__":
    main()
