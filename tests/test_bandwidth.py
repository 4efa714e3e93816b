"""Peak bandwidth: Apple table lookup, override order, probe cache."""

import json

import pytest

from macinfer.perf import bandwidth


@pytest.mark.parametrize(
    "chip, gbps",
    [("Apple M1", 68.25), ("Apple M1 Pro", 200), ("Apple M2 Max", 400), ("Apple M3 Pro", 150),
     ("Apple M4", 120), ("Apple M4 Pro", 273), ("Apple M2 Ultra", 800), ("Apple M9", None)],
)
def test_apple_table(chip, gbps):
    assert bandwidth.apple_peak(chip) == gbps


def test_override_order(monkeypatch, tmp_path):
    monkeypatch.setenv("MACINFER_HOME", str(tmp_path))
    monkeypatch.setenv("MACINFER_PEAK_BW", "123")
    assert bandwidth.peak_bandwidth(50).gbps == 50  # the flag wins
    assert bandwidth.peak_bandwidth().source.startswith("env")
    monkeypatch.delenv("MACINFER_PEAK_BW")
    monkeypatch.setattr(bandwidth, "apple_chip", lambda: "Apple M3 Max")
    assert (bandwidth.peak_bandwidth().gbps, bandwidth.peak_bandwidth().source) == (400, "apple:M3 Max")


def test_probe_is_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("MACINFER_HOME", str(tmp_path))
    monkeypatch.delenv("MACINFER_PEAK_BW", raising=False)
    monkeypatch.setattr(bandwidth, "apple_chip", lambda: None)
    calls = []
    monkeypatch.setattr(bandwidth, "probe_gbps", lambda: calls.append(1) or 7.5)
    first = bandwidth.peak_bandwidth()
    second = bandwidth.peak_bandwidth()
    assert (first.gbps, first.source) == (7.5, "probe")
    assert (second.gbps, second.source) == (7.5, "probe, cached")
    assert calls == [1]
    assert json.loads((tmp_path / "bandwidth.json").read_text())["gbps"] == 7.5


def test_real_probe_is_plausible():
    gbps = bandwidth.probe_gbps(mib=32, repeats=2)
    assert 0.5 < gbps < 2000


def test_utilisation_arithmetic():
    peak = bandwidth.PeakBandwidth(100.0, "flag")
    # 2 GB per token at 10 tok/s on a 100 GB/s machine: 20%.
    assert bandwidth.utilisation(2e9, 10, peak) == pytest.approx(0.2)
