"""What a verify step costs here: one forward of the embedded model over 1, 2, 3, 4, 5 and 9 new
tokens after a 100-token context (mlx-lm's own model and KV cache, no engine around it), the
median of --reps each. Speculation pays only where T(1 + k) stays near T(1) (docs/speculation.md):
on a Mac decode is memory bound and it does; on a CPU the extra tokens' compute shows.

On the CPU backend the model's linear layers compute 2-4 rows as (W @ x.T).T
(macinfer/modelio/cpu_linear.py); the second column times the same forwards with mlx's own
nn.Linear (x @ W.T), the two measured in alternating rounds in one process (docs/platform.md#cpu-rows).

Usage:
    python scripts/bench/verify_cost.py            # ~1.5 min
    python scripts/bench/verify_cost.py --reps 60 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import macinfer  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from macinfer.modelio.cpu_linear import CpuLinear  # noqa: E402
from macinfer.modelio.loader import load_model  # noqa: E402

WIDTHS = (1, 2, 3, 4, 5, 9)


def forward_ms(model, cache, n: int, reps: int) -> float:
    """Median wall time of a forward over n tokens; the cache trimmed back after each."""
    times = []
    for _ in range(reps):
        x = mx.array([[5] * n])
        t = time.perf_counter()
        mx.eval(model(x, cache=cache))
        times.append(time.perf_counter() - t)
        for c in cache:
            c.trim(n)
    return sorted(times)[len(times) // 2] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two forms (medians over them)")
    args = ap.parse_args()
    model, _, info = load_model(args.model)
    layers = [m for _, m in model.named_modules() if type(m) in (nn.Linear, CpuLinear)]
    forms = {"as loaded": [type(m) for m in layers], "nn.Linear": [nn.Linear] * len(layers)}  # each layer's class
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(100, 200))]), cache=cache))
    forward_ms(model, cache, 1, 5)  # warm-up
    ms = {form: {n: [] for n in WIDTHS} for form in forms}
    for _ in range(args.rounds):
        for form, classes in forms.items():
            for m, cls in zip(layers, classes):
                m.__class__ = cls
            for n in WIDTHS:
                ms[form][n].append(forward_ms(model, cache, n, args.reps))
    kinds = ", ".join(sorted({c.__name__ for c in forms["as loaded"]})) or "none"
    print(f"{info.name}, {mx.default_device()}: forward over 1 + k tokens after 100, median of {args.reps} "
          f"x {args.rounds} rounds; linear layers as loaded: {kinds}")
    base = {form: statistics.median(ms[form][1]) for form in forms}
    print("           as loaded            nn.Linear")
    for n in WIDTHS:
        cols = []
        for form in forms:
            t = statistics.median(ms[form][n])
            cols.append(f"{t:6.1f} ms ({t / base[form]:.2f}x)")
        print(f"  1 + {n - 1}: " + "   ".join(cols))


if __name__ == "__main__":
    main()
