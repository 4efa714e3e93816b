"""Peak bandwidth: Apple table lookup (by chip and GPU core count), parsing the core count
out of captured ioreg / system_profiler output, override order, the CPU probe and its cache."""

import json
import subprocess

import pytest

from macinfer.perf import bandwidth


@pytest.mark.parametrize(
    "chip, gbps",
    [("Apple M1", 68.25), ("Apple M1 Pro", 200), ("Apple M2 Max", 400), ("Apple M3 Pro", 150),
     ("Apple M4", 120), ("Apple M4 Pro", 273), ("Apple M2 Ultra", 800), ("Apple M3 Ultra", 819),
     ("Apple M5", 153), ("Apple M1 (Virtual)", 68.25), ("Apple M9", None), ("Apple M10", None),
     ("Apple M5 Ultra", None), ("Intel(R) Core(TM) i7", None)],
)
def test_apple_table(chip, gbps):
    assert bandwidth.apple_peak(chip) == gbps


@pytest.mark.parametrize(
    "chip, cores, gbps",
    [("Apple M3 Max", 30, 300), ("Apple M3 Max", 40, 400), ("Apple M4 Max", 32, 410), ("Apple M4 Max", 40, 546),
     ("Apple M5 Pro", 20, 307), ("Apple M5 Max", 40, 614),
     # binned parts without a published figure, or no core count: unknown (-> the probe)
     ("Apple M3 Max", None, None), ("Apple M4 Max", 36, None), ("Apple M5 Max", 32, None),
     ("Apple M5 Pro", 16, None),
     # chips whose bins share one figure ignore the count
     ("Apple M4 Pro", 16, 273), ("Apple M4 Pro", 20, 273), ("Apple M5", 8, 153)],
)
def test_binned_parts_are_told_apart_by_gpu_cores(chip, cores, gbps):
    assert bandwidth.apple_peak(chip, cores) == gbps
    assert bandwidth.needs_gpu_cores(chip) == (bandwidth.chip_key(chip) in ("M3 Max", "M4 Max", "M5 Pro", "M5 Max"))


IOREG_M3_MAX = """\
+-o AGXAcceleratorG15X  <class AGXAcceleratorG15X, id 0x1000003a1, registered, matched, active, busy 0 (0 ms), retain 80>
    {
      "IOClass" = "AGXAcceleratorG15X"
      "PerformanceStatistics" = {"In use system memory (driver)"=0,"Alloc system memory"=2453848064,"Device Utilization %"=3}
      "model" = "Apple M3 Max"
      "gpu-core-count" = 30
      "GPUConfigurationVariable" = {"gpu_gen"=15,"num_cores"=30,"num_gps"=4}
      "CFBundleIdentifier" = "com.apple.AGXG15X"
    }
    +-o AGXDeviceUserClient  <class AGXDeviceUserClient, id 0x100000d3e, !registered, !matched, active, busy 0, retain 6>
      {
        "IOUserClientCreator" = "pid 412, WindowServer"
      }
"""

IOREG_TREE = """\
    | |   "model" = "Apple M4 Max"
    | |   "gpu-core-count" = 40
    | |   "IOMatchedAtBoot" = Yes
"""

IOREG_XML = """\
<?xml version="1.0" encoding="UTF-8"?>
<plist version="1.0">
<array>
\t<dict>
\t\t<key>IOClass</key>
\t\t<string>AGXAcceleratorG16X</string>
\t\t<key>gpu-core-count</key>
\t\t<integer>32</integer>
\t</dict>
</array>
</plist>
"""

PROFILER_JSON = """\
{
  "SPDisplaysDataType" : [
    {
      "_name" : "Apple M4 Max",
      "spdisplays_mtlgpufamilysupport" : "spdisplays_metal3",
      "sppci_bus" : "spdisplays_builtin",
      "sppci_cores" : "40",
      "sppci_model" : "Apple M4 Max"
    }
  ]
}
"""


@pytest.mark.parametrize(
    "text, cores",
    [(IOREG_M3_MAX, 30), (IOREG_TREE, 40), (IOREG_XML, 32), ("", None), ("ioreg: command not found", None),
     ('"gpu-core-count" = 30\n"gpu-core-count" = 40', None),  # two different GPUs: cannot tell
     ('"gpu-core-count" = 38\n"gpu-core-count" = 38', 38), ('"gpu-core-count" = 0', None),
     ('"gpu-core-count" = "forty"', None)],
)
def test_gpu_cores_from_ioreg(text, cores):
    assert bandwidth.parse_gpu_cores(text) == cores


@pytest.mark.parametrize(
    "text, cores",
    [(PROFILER_JSON, 40), ("{}", None), ("", None), ("not json", None), ('{"SPDisplaysDataType": [{"sppci_cores": "x"}]}', None),
     ('{"SPDisplaysDataType": [{"_name": "Apple M2"}]}', None), ('{"SPDisplaysDataType": "?"}', None)],
)
def test_gpu_cores_from_system_profiler(text, cores):
    assert bandwidth.parse_profiler_gpu_cores(text) == cores


def test_gpu_cores_read_from_ioreg_on_macos(monkeypatch):
    """On macOS the count comes from ioreg; system_profiler only when ioreg has none."""
    monkeypatch.setattr(bandwidth.platform, "system", lambda: "Darwin")
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd[0])
        out = {"ioreg": "no count here", "system_profiler": PROFILER_JSON}[cmd[0]]
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(bandwidth.subprocess, "run", fake_run)
    bandwidth.gpu_core_count.cache_clear()
    try:
        assert bandwidth.gpu_core_count() == 40
        assert calls == ["ioreg", "system_profiler"]
    finally:
        bandwidth.gpu_core_count.cache_clear()


def test_no_gpu_cores_off_macos(monkeypatch):
    monkeypatch.setattr(bandwidth.platform, "system", lambda: "Linux")
    bandwidth.gpu_core_count.cache_clear()
    try:
        assert bandwidth.gpu_core_count() is None
    finally:
        bandwidth.gpu_core_count.cache_clear()


def test_override_order(monkeypatch, tmp_path):
    monkeypatch.setenv("MACINFER_HOME", str(tmp_path))
    monkeypatch.setenv("MACINFER_PEAK_BW", "123")
    assert bandwidth.peak_bandwidth(50).gbps == 50  # the flag wins
    assert bandwidth.peak_bandwidth().source.startswith("env")
    monkeypatch.delenv("MACINFER_PEAK_BW")
    monkeypatch.setattr(bandwidth, "apple_chip", lambda: "Apple M3 Max")
    monkeypatch.setattr(bandwidth, "gpu_core_count", lambda: 30)
    assert (bandwidth.peak_bandwidth().gbps, bandwidth.peak_bandwidth().source) == (300, "apple:M3 Max, 30-core GPU")
    monkeypatch.setattr(bandwidth, "apple_chip", lambda: "Apple M2 Pro")
    assert (bandwidth.peak_bandwidth().gbps, bandwidth.peak_bandwidth().source) == (200, "apple:M2 Pro")


def test_unknown_binned_part_falls_back_to_the_probe(monkeypatch, tmp_path):
    """An M4 Max whose GPU core count cannot be read is not guessed at: the CPU probe measures."""
    monkeypatch.setenv("MACINFER_HOME", str(tmp_path))
    monkeypatch.delenv("MACINFER_PEAK_BW", raising=False)
    monkeypatch.setattr(bandwidth, "apple_chip", lambda: "Apple M4 Max")
    monkeypatch.setattr(bandwidth, "gpu_core_count", lambda: None)
    monkeypatch.setattr(bandwidth, "probe_gbps", lambda: 120.0)
    assert (bandwidth.peak_bandwidth().gbps, bandwidth.peak_bandwidth().source) == (120.0, "CPU probe, cached")
    monkeypatch.setattr(bandwidth, "gpu_core_count", lambda: 40)
    assert (bandwidth.peak_bandwidth().gbps, bandwidth.peak_bandwidth().source) == (546, "apple:M4 Max, 40-core GPU")


def no_chip(monkeypatch, tmp_path):
    monkeypatch.setenv("MACINFER_HOME", str(tmp_path))
    monkeypatch.delenv("MACINFER_PEAK_BW", raising=False)
    monkeypatch.setattr(bandwidth, "apple_chip", lambda: None)


def counting_probe(monkeypatch, gbps=7.5):
    calls = []
    monkeypatch.setattr(bandwidth, "probe_gbps", lambda: calls.append(1) or gbps)
    return calls


def test_probe_is_measured_once_and_cached(monkeypatch, tmp_path):
    no_chip(monkeypatch, tmp_path)
    calls = counting_probe(monkeypatch)
    first = bandwidth.peak_bandwidth()
    second = bandwidth.peak_bandwidth()
    path = tmp_path / "bandwidth.json"
    assert (first.gbps, first.source, first.detail) == (7.5, "CPU probe", f"measured now, cached in {path}")
    assert (second.gbps, second.source) == (7.5, "CPU probe, cached") and second.detail.endswith(f", {path}")
    assert f"(CPU probe, cached: measured 20" in second.describe()  # when, and which file
    assert calls == [1]
    assert json.loads(path.read_text())["gbps"] == 7.5
    assert [p.name for p in tmp_path.iterdir()] == ["bandwidth.json"]  # no temporary file left


PROCESS = """
import json, sys
from macinfer.perf import bandwidth
def probe(*a, **k):
    if sys.argv[1] == "fail":
        raise SystemExit("probed")
    return float(sys.argv[1])
bandwidth.probe_gbps = probe
p = bandwidth.peak_bandwidth()
print(json.dumps([p.gbps, p.source, p.detail]))
"""


@pytest.mark.skipif(bandwidth.apple_chip() is not None, reason="the chip table answers before the probe")
def test_a_fresh_process_reads_the_cached_figure_and_does_not_probe(tmp_path):
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MACINFER_PEAK_BW"} | {"MACINFER_HOME": str(tmp_path)}

    def process(arg):
        r = subprocess.run([sys.executable, "-c", PROCESS, arg], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    assert process("12.5")[:2] == [12.5, "CPU probe"]
    gbps, source, detail = process("fail")  # probing would exit with "probed"
    assert (gbps, source) == (12.5, "CPU probe, cached") and str(tmp_path / "bandwidth.json") in detail


def test_another_machine_or_probe_method_measures_again(monkeypatch, tmp_path):
    no_chip(monkeypatch, tmp_path)
    calls = counting_probe(monkeypatch)
    assert bandwidth.peak_bandwidth().source == "CPU probe"
    assert bandwidth.peak_bandwidth().source == "CPU probe, cached"
    monkeypatch.setattr(bandwidth.platform, "node", lambda: "another-host")
    assert bandwidth.peak_bandwidth().source == "CPU probe" and len(calls) == 2
    assert bandwidth.peak_bandwidth().source == "CPU probe, cached"
    monkeypatch.setattr(bandwidth, "PROBE_METHOD", bandwidth.PROBE_METHOD + ", changed")
    assert bandwidth.peak_bandwidth().source == "CPU probe" and len(calls) == 3
    monkeypatch.setattr(bandwidth, "probe_threads", lambda: 64)  # more CPUs: another machine too
    assert bandwidth.peak_bandwidth().source == "CPU probe" and len(calls) == 4
    assert json.loads((tmp_path / "bandwidth.json").read_text())["key"] == bandwidth.machine_key()


@pytest.mark.parametrize("content", ["{not json", '{"key": "%s", "gbps": "fast", "measured_at": "x"}',
                                     '{"key": "%s", "gbps": -1, "measured_at": "x"}', '["a list"]', ""])
def test_a_corrupt_cache_file_is_ignored_with_one_warning(monkeypatch, tmp_path, content):
    no_chip(monkeypatch, tmp_path)
    calls = counting_probe(monkeypatch)
    path = tmp_path / "bandwidth.json"
    path.write_text(content.replace("%s", bandwidth.machine_key()))
    with pytest.warns(RuntimeWarning) as record:
        peak = bandwidth.peak_bandwidth()
    assert len(record) == 1 and "\n" not in str(record[0].message)
    assert str(record[0].message).startswith(f"bandwidth: ignoring {path} (")
    assert (peak.gbps, peak.source, calls) == (7.5, "CPU probe", [1])
    assert bandwidth.peak_bandwidth().source == "CPU probe, cached"  # rewritten whole


def test_a_failed_write_leaves_the_old_cache_whole(monkeypatch, tmp_path):
    no_chip(monkeypatch, tmp_path)
    counting_probe(monkeypatch)
    path = tmp_path / "bandwidth.json"
    path.write_text(json.dumps({"key": "another machine's", "gbps": 99.0, "measured_at": "x"}))

    def fail(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bandwidth.os, "replace", fail)
    peak = bandwidth.peak_bandwidth()
    assert (peak.source, peak.detail) == ("CPU probe", "measured now, not cached (No space left on device)")
    assert json.loads(path.read_text())["gbps"] == 99.0
    assert [p.name for p in tmp_path.iterdir()] == ["bandwidth.json"]


def test_real_probe_is_plausible():
    gbps = bandwidth.probe_gbps(mib=32, seconds=0)
    assert 0.5 < gbps < 2000
    assert 1 <= bandwidth.probe_threads() <= 16


def test_the_probe_is_the_fastest_sum_timed_by_cpu_time(monkeypatch):
    """Each sum is timed by the thread's own CPU clock (time.thread_time), so time spent descheduled
    on a shared host is not read as slow memory; the slices are summed in turn (none is still in a
    cache when it comes round again) and the figure is the fastest sum. The spies record the real
    clock values and the figure is recomputed from them."""
    import time

    import numpy as np

    clock, sums = [], []
    real_clock, real_sum = time.thread_time, np.sum

    def thread_time():
        clock.append(real_clock())
        return clock[-1]

    def np_sum(a, *k, **kw):
        sums.append((a.nbytes, a.ctypes.data, len(clock)))
        return real_sum(a, *k, **kw)

    monkeypatch.setattr(time, "thread_time", thread_time)
    monkeypatch.setattr(np, "sum", np_sum)
    gbps = bandwidth.probe_gbps(mib=8, seconds=0, min_trials=20)

    assert len(sums) == 20 and len(clock) == 40
    assert all(nbytes == 2**20 for nbytes, _, _ in sums)  # 8 slices of 8 MiB
    addresses = [addr for _, addr, _ in sums]
    assert len(set(addresses[:8])) == 8 and addresses[8:] == addresses[:12]  # in turn
    rates = [nbytes / max(clock[at] - clock[at - 1], 1e-9) / 1e9 for nbytes, _, at in sums]
    assert gbps == max(rates)


def test_utilisation_arithmetic():
    peak = bandwidth.PeakBandwidth(100.0, "flag")
    # 2 GB per token at 10 tok/s on a 100 GB/s machine: 20%.
    assert bandwidth.utilisation(2e9, 10, peak) == pytest.approx(0.2)
