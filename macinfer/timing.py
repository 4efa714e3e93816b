"""Timing MLX work: the median of repeated, fully evaluated runs after a warm-up."""

from __future__ import annotations

import statistics
import time


def median_ms(fn, repeats: int) -> float:
    """Median milliseconds of mx.eval(fn()) over `repeats` runs, after one warm-up run (compilation)."""
    import mlx.core as mx

    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)
