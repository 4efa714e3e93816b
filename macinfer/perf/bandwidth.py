"""The machine's peak memory bandwidth, the denominator of bandwidth utilisation.

Decode is memory-bound: every token reads all the weights (and the KV cache)
once. So `bytes read per token x tokens/s / peak bandwidth` says how close to
the hardware limit a decoder runs (good ones reach 70-85% on Apple silicon).

Peak comes from, in order: an explicit value (flag / MACINFER_PEAK_BW in GB/s),
Apple's published figure for the detected chip (and, where binned parts of one
chip differ, its GPU core count), or a short measured probe cached on disk.

The probe sums a 256 MiB array with numpy on the CPU, on one thread and on
several (numpy releases the GIL), best of 5 each. It measures what the CPU cores
can read, which is below the chip's peak on Apple silicon (the GPU reads faster),
so its source says "CPU probe".
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# Apple's published unified-memory bandwidth, GB/s, by chip name (after "Apple ").
# A dict maps GPU core count -> GB/s where the binned parts of one chip differ
# (docs/platform.md); a core count not listed there is unknown, and the probe is used.
# M5 Pro and M5 Max: Apple's announcement (March 2026) gives "up to" 307 and 614 GB/s,
# so only the full-GPU parts (20 and 40 cores) are listed.
APPLE_PEAK_GBPS: dict[str, float | dict[int, float]] = {
    "M1": 68.25, "M1 Pro": 200, "M1 Max": 400, "M1 Ultra": 800,
    "M2": 100, "M2 Pro": 200, "M2 Max": 400, "M2 Ultra": 800,
    "M3": 100, "M3 Pro": 150, "M3 Max": {30: 300, 40: 400}, "M3 Ultra": 819,
    "M4": 120, "M4 Pro": 273, "M4 Max": {32: 410, 40: 546},
    "M5": 153, "M5 Pro": {20: 307}, "M5 Max": {40: 614},
}

_CHIP = re.compile(r"\bM(\d+)(?:\s+(Pro|Max|Ultra))?\b")


@dataclass
class PeakBandwidth:
    gbps: float
    source: str  # "flag", "env", "apple:M2 Pro", "apple:M3 Max, 40-core GPU", "CPU probe", "CPU probe, cached"

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


def chip_key(chip: str) -> str | None:
    """'Apple M3 Max' -> 'M3 Max', 'Apple M1 (Virtual)' -> 'M1'; None if no M-series name is in it."""
    m = _CHIP.search(chip)
    if not m:
        return None
    return f"M{m.group(1)}" + (f" {m.group(2)}" if m.group(2) else "")


def needs_gpu_cores(chip: str) -> bool:
    """Whether the chip's binned parts differ in bandwidth (so the GPU core count decides)."""
    return isinstance(APPLE_PEAK_GBPS.get(chip_key(chip) or ""), dict)


def apple_peak(chip: str, gpu_cores: int | None = None) -> float | None:
    """Peak GB/s for a chip name like 'Apple M3 Max' and its GPU core count.

    None if the chip is not in the table, or if its binned parts differ and
    gpu_cores is missing or not one Apple published a figure for.
    """
    entry = APPLE_PEAK_GBPS.get(chip_key(chip) or "")
    if isinstance(entry, dict):
        return entry.get(gpu_cores) if gpu_cores is not None else None
    return entry


def parse_gpu_cores(text: str) -> int | None:
    """The GPU core count in `ioreg -rc AGXAccelerator` output (text, `-l` tree or `-a` XML).

    None when no count is there or the counts found disagree.
    """
    found = re.findall(r'"gpu-core-count"\s*=\s*(\d+)', text)
    found += re.findall(r"<key>gpu-core-count</key>\s*<integer>\s*(\d+)\s*</integer>", text)
    values = {int(v) for v in found if 0 < int(v) <= 4096}
    return values.pop() if len(values) == 1 else None


def parse_profiler_gpu_cores(text: str) -> int | None:
    """The GPU core count in `system_profiler SPDisplaysDataType -json` output ("sppci_cores")."""
    try:
        displays = json.loads(text).get("SPDisplaysDataType", [])
        values = {int(str(d["sppci_cores"]).strip()) for d in displays if isinstance(d, dict) and "sppci_cores" in d}
    except (ValueError, TypeError, AttributeError):
        return None
    values = {v for v in values if 0 < v <= 4096}
    return values.pop() if len(values) == 1 else None


@functools.lru_cache(maxsize=1)
def gpu_core_count() -> int | None:
    """The GPU core count on macOS: IORegistry `gpu-core-count`, else system_profiler; None elsewhere."""
    if platform.system() != "Darwin":
        return None
    for cmd, parse, timeout in (
        (["ioreg", "-rc", "AGXAccelerator"], parse_gpu_cores, 5),
        (["system_profiler", "SPDisplaysDataType", "-json"], parse_profiler_gpu_cores, 15),
    ):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError):
            continue
        if (cores := parse(out.stdout)) is not None:
            return cores
    return None


def probe_threads() -> int:
    """Threads the probe reads with: the usable CPUs, at most 16."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(16, n))


def probe_gbps(mib: int = 256, repeats: int = 5, threads: int | None = None) -> float:
    """Measured CPU read bandwidth: best of `repeats` sums over a `mib` MiB array, on one
    thread and on `threads` threads (default `probe_threads()`), each summing a slice."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    a = np.ones(mib * 2**20 // 4, dtype=np.float32)
    a.sum()  # fault the pages in
    best = float("inf")
    for n in sorted({1, threads or probe_threads()}):
        parts = np.array_split(a, n)
        with ThreadPoolExecutor(n) as pool:
            for _ in range(repeats):
                t = time.perf_counter()
                sum(pool.map(np.sum, parts))
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
    if chip:
        cores = gpu_core_count() if needs_gpu_cores(chip) else None
        if gbps := apple_peak(chip, cores):
            return PeakBandwidth(gbps, f"apple:{chip_key(chip)}" + (f", {cores}-core GPU" if cores else ""))
    # v2: the probe reads with several threads (v1 used one and is measured again)
    key = f"v2|{platform.node()}|{platform.machine()}|{platform.processor()}"
    path = _cache_file()
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return PeakBandwidth(float(cached["gbps"]), "CPU probe, cached")
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
    return PeakBandwidth(gbps, "CPU probe")


def bytes_per_step(info, kv_tokens: float) -> float:
    """Bytes one decode forward reads: the weights it streams (info.bytes_per_decode_step) plus
    the K/V of kv_tokens context tokens (info.kv_bytes_per_token each)."""
    return info.bytes_per_decode_step + kv_tokens * info.kv_bytes_per_token


def utilisation(bytes_per_step: float, steps_per_s: float, peak: PeakBandwidth) -> float:
    """Fraction of peak bandwidth used: bytes/step x steps/s / peak."""
    return bytes_per_step * steps_per_s / (peak.gbps * 1e9)
