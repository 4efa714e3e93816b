"""`macinfer doctor`: every check reported as ran / skipped / failed, one line each, never a traceback.

This host has no Metal, so the kernel checks must be skipped with a reason; their Mac
path is run here against a stand-in kernel (the engine's own reference attention,
or a wrong one) with a small grid.
"""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from click.testing import CliRunner

from macinfer.cli import doctor
from macinfer.cli.main import main
from macinfer.kv import metal_attention as ma
from macinfer.kv.paged_attention import paged_attention

STATUSES = {"ran", "skipped", "failed"}
# This host's outcome without Metal (kernel checks skipped, bandwidth probed on the CPU); a Mac runs them.
no_metal_host = pytest.mark.skipif(mx.metal.is_available(), reason="asserts what doctor says without Metal")


@pytest.fixture(autouse=True)
def _home(monkeypatch, tmp_path):
    """The bandwidth probe's cache in a temporary home; no peak override from the environment."""
    monkeypatch.setenv("MACINFER_HOME", str(tmp_path))
    monkeypatch.delenv("MACINFER_PEAK_BW", raising=False)


def invoke(*args):
    return CliRunner().invoke(main, ["doctor", *args])


@no_metal_host
def test_json_quick_on_this_host():
    r = invoke("--json", "--quick")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)  # the whole of stdout is one object
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == list(doctor.CHECKS)
    for c in report["checks"]:
        assert c["status"] in STATUSES, c
        assert isinstance(c["figures"], dict)
        assert (c.get("summary") if c["status"] == "ran" else c.get("reason")), c
    for name in ("system", "software", "metal", "bandwidth"):
        assert checks[name]["status"] == "ran", checks[name]
    assert checks["metal"]["figures"]["available"] is False
    for name in ("kernel_self_check", "kernel_timing"):
        assert checks[name]["status"] == "skipped"
        assert "no Metal" in checks[name]["reason"]
    assert checks["decode"]["status"] == "skipped" and "--quick" in checks["decode"]["reason"]
    assert checks["software"]["figures"]["mlx"] == mx.__version__
    bw = checks["bandwidth"]["figures"]
    assert bw["gbps"] > 0 and bw["source"] == "CPU probe"
    assert checks["system"]["figures"]["python"].count(".") == 2


@no_metal_host
def test_text_is_one_line_per_check():
    r = invoke("--quick")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert len(lines) == len(doctor.CHECKS)
    for name, line in zip(doctor.CHECKS, lines):
        fields = line.split()
        assert fields[0] == name and fields[1] in STATUSES, line
    assert "Metal available: no" in lines[doctor.CHECKS.index("metal")]
    assert "CPU probe" in lines[doctor.CHECKS.index("bandwidth")]


def test_a_check_that_raises_is_one_failed_line(monkeypatch):
    def boom(ctx):
        raise RuntimeError("boom\n  in a second line")

    monkeypatch.setattr(doctor, "check_software", boom)
    r = invoke("--quick")
    assert r.exit_code == 1
    assert "Traceback" not in r.output
    lines = r.stdout.splitlines()
    assert len(lines) == len(doctor.CHECKS)  # the others still ran
    assert lines[1].split()[:2] == ["software", "failed"]
    assert lines[1].endswith("RuntimeError: boom in a second line")
    r = invoke("--quick", "--json")
    assert r.exit_code == 1 and "Traceback" not in r.output
    software = next(c for c in json.loads(r.stdout)["checks"] if c["name"] == "software")
    assert (software["status"], software["reason"]) == ("failed", "RuntimeError: boom in a second line")


def test_help_has_an_example():
    r = invoke("--help")
    assert r.exit_code == 0
    assert "macinfer doctor --quick --json" in r.output
    assert "doctor" in CliRunner().invoke(main, ["--help"]).output


def test_stdout_is_only_the_json_object_in_a_real_process(tmp_path):
    code = "from macinfer.cli.main import main; main()"
    p = subprocess.run([sys.executable, "-c", code, "doctor", "--json", "--quick"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert len(p.stdout.strip().splitlines()) == 1
    assert {c["name"] for c in json.loads(p.stdout)["checks"]} == set(doctor.CHECKS)
    assert "Traceback" not in p.stderr


def reference_kernel(*args, n_simdgroups=None, lens=None, sink_array=None, **kw):
    """'The kernel': the engine's reference behind the kernel's signature."""
    return paged_attention(*args, **kw)


@pytest.fixture
def fake_metal(monkeypatch):
    """Pretend Metal is here, with the engine's reference as 'the kernel' and small grids."""
    monkeypatch.setattr(ma, "metal_available", lambda: True)
    monkeypatch.setattr(ma, "build_kernel", lambda kind="float": None)
    monkeypatch.setattr(ma, "paged_attention_metal", reference_kernel)
    monkeypatch.setattr(doctor, "GRID_HEAD_DIMS", (64,))
    monkeypatch.setattr(doctor, "GRID_BLOCK_SIZES", (16,))
    monkeypatch.setattr(doctor, "TIMING_BATCHES", (1, 2))
    monkeypatch.setattr(doctor, "TIMING_CONTEXTS", (32, 48))


def test_kernel_checks_on_a_mac(fake_metal):
    results = {r["name"]: r for r in doctor.run_checks(quick=True)}
    check = results["kernel_self_check"]
    assert check["status"] == "ran", check
    kinds = 2 * len(ma.SUPPORTED_DTYPES)  # float and 8-bit KV pools, three dtypes
    assert check["figures"]["classes"] == kinds * 6 and check["figures"]["cases"] == kinds * 6 * 3
    assert set(check["figures"]["max_abs_diff"]) == {f"{t}{q}" for t in ("float32", "float16", "bfloat16")
                                                     for q in ("", " kv8")}
    timing = results["kernel_timing"]
    assert timing["status"] == "ran", timing
    rows = timing["figures"]["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 32), (1, 48), (2, 32), (2, 48)]
    assert all(r["kernel_ms"] > 0 and r["sdpa_ms"] > 0 and r["kernel_over_sdpa"] > 0 for r in rows)
    assert "b2" in timing["summary"] and "x)" in timing["summary"]
    assert results["metal"]["figures"]["available"] is True


def test_a_wrong_kernel_fails_its_check_and_is_not_timed(fake_metal, monkeypatch):
    def wrong(*args, **kw):
        return reference_kernel(*args, **kw) + 0.5

    monkeypatch.setattr(ma, "paged_attention_metal", wrong)
    r = invoke("--quick")
    assert r.exit_code == 1 and "Traceback" not in r.output
    lines = {line.split()[0]: line for line in r.stdout.splitlines()}
    assert lines["kernel_self_check"].split()[1] == "failed"
    assert "disagrees with the reference" in lines["kernel_self_check"]
    assert lines["kernel_timing"].split()[1] == "skipped"
    assert "self-check" in lines["kernel_timing"]


def test_a_pipeline_thread_limit_is_retried_as_the_engine_does(fake_metal, monkeypatch):
    """MLX refuses a 256-thread dispatch where a pipeline allows 192: the engine retries at that limit, so
    doctor must too, and say so (it reported a failure the engine recovers from)."""
    def limited(*args, n_simdgroups=None, **kw):
        if 32 * (n_simdgroups or ma.MAX_SIMDGROUPS) > 192:  # MLX's own message (custom_kernel.cpp)
            raise ValueError(f"Thread group size ({32 * n_simdgroups}) is greater than  the maximum allowed "
                             "threads per threadgroup (192).")
        return reference_kernel(*args, **kw)

    monkeypatch.setattr(ma, "paged_attention_metal", limited)
    results = {r["name"]: r for r in doctor.run_checks(quick=True)}
    check = results["kernel_self_check"]
    assert check["status"] == "ran", check
    assert set(check["figures"]["thread_limited"].values()) == {192} and "lowered" in check["summary"]
    assert results["kernel_timing"]["status"] == "ran", results["kernel_timing"]


def test_decode_check_reports_bandwidth_utilisation(tiny_models, monkeypatch):
    """The decode check's plumbing on a tiny model (the embedded one takes a minute or more here)."""
    monkeypatch.setattr(doctor, "DECODE_MODEL", str(tiny_models("llama")))
    monkeypatch.setattr(doctor, "DECODE_TOKENS", 8)
    monkeypatch.setenv("MACINFER_PEAK_BW", "100")
    ctx = {"quick": False}
    doctor.run_check("bandwidth", ctx)
    result = doctor.run_check("decode", ctx)
    assert result["status"] == "ran", result
    f = result["figures"]
    assert f["generation_tokens"] == 8 and f["attention"] == "reference"
    assert f["peak_bandwidth_gbps"] == 100 and f["peak_bandwidth_source"].startswith("env")
    assert f["bandwidth_utilisation"] == pytest.approx(f["bytes_per_decode_step"] * f["decode_tps"] / 100e9, rel=0.05)
    assert "8 tokens" in result["summary"] and "% of 100.0 GB/s" in result["summary"]


def test_mac_check_dry_run_prints_every_step():
    """scripts/mac_check.sh --dry-run: every step's command, what this host would skip and why; nothing run."""
    from pathlib import Path

    root = Path(__file__).parents[1]
    p = subprocess.run(["bash", str(root / "scripts" / "mac_check.sh"), "--dry-run"], capture_output=True, text=True,
                       timeout=300, env={**__import__("os").environ, "PYTHON": sys.executable})
    assert p.returncode == 0, p.stderr
    steps = [line.split("]")[0][3:] for line in p.stdout.splitlines() if line.startswith("+ [")]
    assert steps == ["install", "doctor", "metal_tests", "emulator", "metal_compile", "attention_timing",
                     "bench_embedded", "bench_catalog", "report"]
    assert "scripts/install.sh --test" in p.stdout and "doctor --json" in p.stdout and "xcrun" in p.stdout
    assert "--compare mlx-lm" in p.stdout
    if not mx.metal.is_available():
        skipped = [line for line in p.stdout.splitlines() if "# on this host: skipped" in line]
        assert len(skipped) == 4 and all("Metal" in s or "xcrun" in s for s in skipped)
