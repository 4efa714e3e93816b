"""Benchmark the CPU bandwidth probe's stability: the same probe, run again and again in fresh processes.

`macinfer.perf.bandwidth.probe_gbps` is the denominator of bandwidth utilisation on a host
without a chip table, so a run-to-run swing shows up as a swing in utilisation. Each round
runs, each in a process of its own, the probe and the baseline (the previous method: wall time,
best of 5, one thread and all of them, kept here as it was), in alternating order; every other
round a load process streams memory on one core beside them (a shared host's neighbour). The
figures are each method's min / median / max over the rounds and its spread, (max - min) /
median; the criterion is a spread under 10%.

Usage:
    python scripts/bench/bandwidth.py                 # 10 rounds, ~1-2 min on 2 shared cores
    python scripts/bench/bandwidth.py --rounds 4 --no-load
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LOAD = "import numpy as np\na = np.ones(2**25, dtype=np.float32)\nwhile True:\n    a.sum()\n"


def baseline_gbps(mib: int = 256, repeats: int = 5) -> float:
    """The previous probe: the best wall time of `repeats` sums, on one thread and on all of them."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from macinfer.perf.bandwidth import probe_threads

    a = np.ones(mib * 2**20 // 4, dtype=np.float32)
    a.sum()
    best = float("inf")
    for n in sorted({1, probe_threads()}):
        parts = np.array_split(a, n)
        with ThreadPoolExecutor(n) as pool:
            for _ in range(repeats):
                t = time.perf_counter()
                sum(pool.map(np.sum, parts))
                best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def child(method: str) -> None:
    from macinfer.perf.bandwidth import probe_gbps

    t = time.perf_counter()
    gbps = probe_gbps() if method == "probe" else baseline_gbps()
    print(json.dumps({"gbps": gbps, "seconds": time.perf_counter() - t}))


def run(method: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", method], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(name: str, rows: list[dict]) -> str:
    g = [r["gbps"] for r in rows]
    med = statistics.median(g)
    return (f"   {name:9s} min {min(g):6.1f}  median {med:6.1f}  max {max(g):6.1f} GB/s   spread {(max(g) - min(g)) / med:6.1%}"
            f"   (max/min {max(g) / min(g):.2f}x; {statistics.median(r['seconds'] for r in rows):.2f} s per probe)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--no-load", action="store_true", help="no load process in any round")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    from macinfer.perf.bandwidth import PROBE_METHOD, probe_threads

    print(f"probe: {PROBE_METHOD}; {probe_threads()} usable CPUs; baseline: wall time, best of 5")
    results: dict[str, list[dict]] = {"probe": [], "baseline": []}
    for i in range(args.rounds):
        loaded = not args.no_load and i % 2 == 1
        load = subprocess.Popen([sys.executable, "-c", LOAD]) if loaded else None
        try:
            time.sleep(0.5 if loaded else 0)
            order = ("probe", "baseline") if i % 4 < 2 else ("baseline", "probe")
            got = {m: run(m) for m in order}
        finally:
            if load is not None:
                load.kill()
                load.wait()
        for m in results:
            results[m].append(got[m])
        print(f"   round {i + 1:2d}{' (load)' if loaded else '       '}: probe {got['probe']['gbps']:6.1f}"
              f"   baseline {got['baseline']['gbps']:6.1f} GB/s", flush=True)
    print(f"\n{args.rounds} rounds, each method in a fresh process per round:")
    for m, rows in results.items():
        print(summary(m, rows))


if __name__ == "__main__":
    main()
