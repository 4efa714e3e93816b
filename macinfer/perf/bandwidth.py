"""The machine's peak memory bandwidth, the denominator of bandwidth utilisation.

Decode is memory-bound: every token reads all the weights (and the KV cache)
once. So `bytes read per token x tokens/s / peak bandwidth` says how close to
the hardware limit a decoder runs (good ones reach 70-85% on Apple silicon).

Peak comes from, in order: an explicit value (flag / MACINFER_PEAK_BW in GB/s),
Apple's published figure for the detected chip, or a short measured probe
(numpy sum over a 256 MiB array, best of 5) cached on disk.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# Apple's published unified-memory bandwidth, GB/s. Keys are matched longest first
# against the chip name, e.g. "Apple M2 Pro".
APPLE_PEAK_GBPS = {
    "M1": 68.25, "M1 Pro": 200, "M1 Max": 400, "M1 Ultra": 800,
    "M2": 100, "M2 Pro": 200, "M2 Max": 400, "M2 Ultra": 800,
    "M3": 100, "M3 Pro": 150, "M3 Max": 400, "M3 Ultra": 800,
    "M4": 120, "M4 Pro": 273, "M4 Max": 546,
}


@dataclass
class PeakBandwidth:
    gbps: float
    source: str  # "flag", "env", "apple:M2 Pro", "probe", "probe, cached"

    def describe(self) -> str:
        return f"{self.gbps:.1f} GB/s ({self.source})"


def apple_chip() -> str | None:
    if platform.system() != "Darwin":
        return None
    try:
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=2)
    except (OSError, subprocess.SubprocessError):
        return None
    name = out.stdout.strip()
    return name if name.startswith("Apple") else None


def apple_peak(chip: str) -> float | None:
    """Peak GB/s for a chip name like 'Apple M3 Max' (None if unknown)."""
    name = chip.replace("Apple", "").strip()
    for key in sorted(APPLE_PEAK_GBPS, key=len, reverse=True):
        if name == key or name.startswith(key + " ") and key.count(" ") == name.count(" "):
            return APPLE_PEAK_GBPS[key]
    for key in sorted(APPLE_PEAK_GBPS, key=len, reverse=True):
        if name.startswith(key):
            return APPLE_PEAK_GBPS[key]
    return None


def probe_gbps(mib: int = 256, repeats: int = 5) -> float:
    """Measured read bandwidth: best of `repeats` sums over a `mib` MiB array."""
    import numpy as np

    a = np.ones(mib * 2**20 // 4, dtype=np.float32)
    a.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def _cache_file() -> Path:
    from macinfer.paths import cache_dir

    return cache_dir() / "bandwidth.json"


def peak_bandwidth(override: float | None = None, probe: bool = True) -> PeakBandwidth | None:
    """Find the peak bandwidth (see module docstring). None only if probe=False and nothing else known."""
    if override:
        return PeakBandwidth(float(override), "flag")
    env = os.environ.get("MACINFER_PEAK_BW")
    if env:
        try:
            return PeakBandwidth(float(env), "env MACINFER_PEAK_BW")
        except ValueError:
            pass
    chip = apple_chip()
    if chip and (gbps := apple_peak(chip)):
        return PeakBandwidth(gbps, chip.replace("Apple ", "apple:"))
    key = f"{platform.node()}|{platform.machine()}|{platform.processor()}"
    path = _cache_file()
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return PeakBandwidth(float(cached["gbps"]), "probe, cached")
    except (OSError, ValueError, KeyError):
        pass
    if not probe:
        return None
    gbps = probe_gbps()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "gbps": gbps}))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home is no reason to fail a run
    return PeakBandwidth(gbps, "probe")


def bytes_per_step(info, kv_tokens: float) -> float:
    """Bytes one decode forward reads: the weights it streams (info.bytes_per_decode_step) plus
    the K/V of kv_tokens context tokens (info.kv_bytes_per_token each)."""
    return info.bytes_per_decode_step + kv_tokens * info.kv_bytes_per_token


def utilisation(bytes_per_step: float, steps_per_s: float, peak: PeakBandwidth) -> float:
    """Fraction of peak bandwidth used: bytes/step x steps/s / peak."""
    return bytes_per_step * steps_per_s / (peak.gbps * 1e9)
