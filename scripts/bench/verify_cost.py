"""What a verify step costs here: one forward of the embedded model over 1, 2, 3, 5 and 9 new
tokens after a 100-token context (mlx-lm's own model and KV cache, no engine around it), the
median of --reps each. Speculation pays only where T(1 + k) stays near T(1) (docs/speculation.md):
on a Mac decode is memory bound and it does; on a CPU the extra tokens' compute shows.

Usage:
    python scripts/bench/verify_cost.py            # ~30 s
    python scripts/bench/verify_cost.py --reps 60
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import macinfer  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from macinfer.modelio.loader import load_model  # noqa: E402

WIDTHS = (1, 2, 3, 5, 9)


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
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    model, _, info = load_model(args.model)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(100, 200))]), cache=cache))
    forward_ms(model, cache, 1, 5)  # warm-up
    base = forward_ms(model, cache, 1, args.reps)
    print(f"{info.name} ({info.dtype if hasattr(info, 'dtype') else ''}), {mx.default_device()}: "
          f"forward over 1 + k tokens after 100, median of {args.reps}")
    for n in WIDTHS:
        ms = base if n == 1 else forward_ms(model, cache, n, args.reps)
        print(f"  1 + {n - 1}: {ms:6.1f} ms  ({ms / base:.2f}x one token)")


if __name__ == "__main__":
    main()
