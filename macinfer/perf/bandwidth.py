"""The machine's peak memory bandwidth, the denominator of bandwidth utilisation.

Decode is memory-bound: every token reads all the weights (and the KV cache)
once. So `bytes read per token x tokens/s / peak bandwidth` says how close to
the hardware limit a decoder runs (good ones reach 70-85% on Apple silicon).

Peak comes from, in order: an explicit value (flag / MACINFER_PEAK_BW in GB/s),
Apple's published figure for the detected chip (and, where binned parts of one
chip differ, its GPU core count), or a measured CPU probe cached on disk.

The probe is one CPU core's read rate at its best: numpy sums 32 MiB slices of a 256 MiB
array (in turn, so none is still in a cache) for 2 s, each sum timed by the thread's CPU time
(`time.thread_time`), and the figure is the fastest. Why, measured on a loaded 2-core host
(docs/platform.md#bandwidth-probe, scripts/bench/bandwidth.py):
- wall time counts the time a thread waits descheduled: wall-time figures swung 2x and more
  between runs (16.5 vs 32.2 GB/s; best of 5 over 10 fresh processes: 105-195% apart, against
  12-21% for this probe);
- a neighbour streaming memory lowers even CPU-time rates for seconds at a time, so a median,
  or a short probe, follows the neighbours; the fastest sum of a 2 s probe does not (contention
  only ever slows a sum down);
- one core, not all of them: several threads that run one after the other (a busy host) each
  read as fast as one alone, while side by side (a quiet one) they share the memory system, so
  an all-cores figure moves with the host's load. NOTE: so on hosts where all cores together
  read faster than one, this is a lower bound of the machine's peak; MLX's CPU backend runs
  most ops on one core. It is also below the chip's peak on Apple silicon (the GPU reads
  faster), so its source says "CPU probe".

The figure is cached in `cache_dir()/bandwidth.json`, written atomically, keyed by
the machine (host name, machine id, CPU model, usable CPUs, memory) and the probe
method (PROBE_METHOD): another machine or another method measures again, and a file
that cannot be read is ignored with one warning. `describe()` says which it was:
"CPU probe, measured now" or "CPU probe, cached" with the date and the file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import subprocess
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from macinfer.errors import MacinferWarning
from macinfer.paths import cache_dir

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


# The probe's method: part of the cache key, so a figure measured another way is measured again.
PROBE_METHOD = "one thread, numpy sums of 32 MiB slices of 256 MiB, CPU time, the fastest of 2 s"
PROBE_MIB, PROBE_SLICES, PROBE_SECONDS, PROBE_MIN_TRIALS = 256, 8, 2.0, 16


@dataclass
class PeakBandwidth:
    gbps: float
    source: str  # "flag", "env", "apple:M2 Pro", "apple:M3 Max, 40-core GPU", "CPU probe", "CPU probe, cached"
    detail: str = ""  # for a probe: when it was measured and the cache file

    def describe(self) -> str:
        return f"{self.gbps:.1f} GB/s ({self.source}{': ' + self.detail if self.detail else ''})"


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
    """The usable CPUs, at most 16 (part of the machine's key)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(16, n))


def _read_rate(part) -> float:
    """GB/s at which this thread sums `part`: its bytes / the CPU time this thread spent on them."""
    import numpy as np

    t = time.thread_time()
    np.sum(part)
    return part.nbytes / max(time.thread_time() - t, 1e-9) / 1e9


def probe_gbps(mib: int = PROBE_MIB, seconds: float = PROBE_SECONDS, min_trials: int = PROBE_MIN_TRIALS) -> float:
    """One CPU core's read bandwidth (GB/s): the fastest of the sums made over `seconds` (at least
    `min_trials`) of the slices of a `mib` MiB array, in turn, each timed by its CPU time."""
    import numpy as np

    a = np.ones(mib * 2**20 // 4, dtype=np.float32)
    a.sum()  # fault the pages in
    slices = np.array_split(a, PROBE_SLICES)
    best, k, start = 0.0, 0, time.perf_counter()
    while k < min_trials or time.perf_counter() - start < seconds:
        best = max(best, _read_rate(slices[k % len(slices)]))
        k += 1
    return best


def _machine_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            return Path(path).read_text().strip()
        except OSError:
            continue
    return ""


def cpu_model() -> str:
    """The CPU's name: /proc/cpuinfo's model name, else the Apple chip, else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return apple_chip() or platform.processor() or platform.machine()


def machine_key() -> str:
    """What a cached probe figure is valid for: this machine and PROBE_METHOD (a short hash of both)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    parts = [PROBE_METHOD, platform.node(), _machine_id(), platform.machine(), cpu_model(), str(probe_threads()),
             str(memory)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def cache_file() -> Path:
    return cache_dir() / "bandwidth.json"


def cached_probe(key: str) -> PeakBandwidth | None:
    """The figure cached for `key`; None if there is none or it is another machine's or method's.

    A file that cannot be read (corrupt, not ours) is ignored with one warning.
    """
    path = cache_file()
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            return None
        gbps, measured = float(data["gbps"]), str(data["measured_at"])
        if not 0 < gbps < 1e5:
            raise ValueError(f"implausible figure {gbps}")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"bandwidth: ignoring {path} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                      "measuring again", MacinferWarning, stacklevel=3)
        return None
    return PeakBandwidth(gbps, "CPU probe, cached", f"measured {measured}, {path}")


def save_probe(key: str, gbps: float) -> str:
    """Cache the figure atomically (a temporary file renamed over the old); the detail for describe()."""
    path = cache_file()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = {"key": key, "gbps": gbps, "method": PROBE_METHOD, "measured_at": time.strftime("%Y-%m-%d %H:%M")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as e:  # a read-only home is no reason to fail a run
        tmp.unlink(missing_ok=True)
        return f"measured now, not cached ({e.strerror or e})"
    return f"measured now, cached in {path}"


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
    key = machine_key()
    if cached := cached_probe(key):
        return cached
    if not probe:
        return None
    gbps = probe_gbps()
    return PeakBandwidth(gbps, "CPU probe", save_probe(key, gbps))


def bytes_per_step(info, kv_tokens: float) -> float:
    """Bytes one decode forward reads: the weights it streams (info.bytes_per_decode_step) plus
    the K/V of kv_tokens context tokens (info.kv_bytes_per_token each)."""
    return info.bytes_per_decode_step + kv_tokens * info.kv_bytes_per_token


def utilisation(bytes_per_step: float, steps_per_s: float, peak: PeakBandwidth) -> float:
    """Fraction of peak bandwidth used: bytes/step x steps/s / peak."""
    return bytes_per_step * steps_per_s / (peak.gbps * 1e9)
