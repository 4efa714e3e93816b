#!/usr/bin/env python3
"""The steps of scripts/mac_check.sh after the install: run each, then write one report (Markdown + JSON).

Standard library only, Python 3.9+ (it may run under Xcode's python3 for --dry-run). Each step is a
command; a step that cannot run on this host is skipped with its reason, and one that fails does
not stop the others. docs/platform.md ("The first Mac run") says what each figure should be.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The suite's tests that need Metal (they skip elsewhere), and the emulator's clang build.
METAL_TESTS = [
    "tests/test_metal_attention.py::test_engine_on_metal_decodes_like_the_reference",
    "tests/test_kernel_dispatch.py::test_real_kernel_matches_reference_on_metal",
    "tests/test_kernel_dispatch.py::test_real_dispatch_serves_every_class_on_metal",
    "tests/test_decode_graph.py::test_pipelined_decode_writes_the_pools_in_place_on_metal",
]
EMULATOR_TESTS = ["tests/test_metal_attention.py", "tests/test_kernel_dispatch.py"]
TIMING_CONTEXTS = "1024,4096,16384,32768"


class Step:
    """One command of the check: name, what it shows, the command, and why it is skipped here (None: it runs)."""

    def __init__(self, name, what, cmd, skip=None, timeout=1800, parse=None):
        self.name, self.what, self.cmd, self.skip, self.timeout, self.parse = name, what, cmd, skip, timeout, parse


def _metal(py: str) -> bool:
    code = "import mlx.core as mx; print(mx.metal.is_available())"
    try:
        return subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120).stdout.strip() == "True"
    except (OSError, subprocess.SubprocessError):
        return False


def _xcrun_metal() -> str | None:
    """Why `xcrun metal` cannot run here, or None."""
    if shutil.which("xcrun") is None:
        return "no xcrun (not a Mac with Xcode's command-line tools)"
    probe = subprocess.run(["xcrun", "-sdk", "macosx", "-f", "metal"], capture_output=True, text=True)
    if probe.returncode != 0:
        return ("no Metal compiler in this Xcode (Xcode 26 installs it apart: "
                "xcodebuild -downloadComponent MetalToolchain)")
    return None


def _catalog_model(py: str) -> str | None:
    """The smallest catalog model already on disk, if any (`macinfer ls --json`)."""
    try:
        out = subprocess.run([py, "-m", "macinfer", "ls", "--json"], capture_output=True, text=True, timeout=300)
        models = json.loads(out.stdout)["models"]
    except (OSError, ValueError, KeyError, subprocess.SubprocessError):
        return None
    local = [m for m in models if m.get("kind") != "embedded" and m.get("downloaded")]
    return min(local, key=lambda m: m.get("size_bytes") or 0)["name"] if local else None


def _pytest_counts(out: str) -> dict:
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}


def _metal_compile(py: str, work: Path) -> list[str]:
    """A shell line: write the sources, then compile each (in parallel) and count."""
    src = work / "metal_sources"
    return ["bash", "-c",
            f'set -o pipefail; inc=$("{py}" scripts/metal_sources.py --out "{src}" | tail -1) && '
            f'ls "{src}"/*.metal | xargs -P 4 -I{{}} sh -c \'xcrun -sdk macosx metal -std=metal3.1 -I "$0" '
            f'-c "{{}}" -o /dev/null 2>&1 || echo "FAILED {{}}"\' "$inc" | tee "{work}/metal_compile.log"; '
            f'n=$(ls "{src}"/*.metal | wc -l); f=$(grep -c "^FAILED" "{work}/metal_compile.log" || true); '
            f'echo "compiled $((n - f)) of $n kernel sources"; [ "$f" -eq 0 ]']


def steps(py: str, metal: bool, work: Path, quick: bool) -> list[Step]:
    no_metal = None if metal else "no Metal on this host (MLX runs on its CPU backend)"
    catalog = _catalog_model(py) if metal else None
    bench = ["-c", "1,4", "-p", "128,2k", "-n", "64", "--repeats", "1" if quick else "3"]
    return [
        Step("doctor", "machine, versions, bandwidth, the kernel's start-up check over a grid, kernel vs SDPA "
             "timing, a 100-token decode", [py, "-m", "macinfer", "doctor", "--json", *(["--quick"] if quick else [])],
             parse=lambda out: json.loads(out.strip().splitlines()[-1])),
        Step("metal_tests", "the suite's Metal-only tests (the real kernel in the engine, every class, pools "
             "written in place under async pipelining)", [py, "-m", "pytest", "-q", "-rs", *METAL_TESTS],
             parse=_pytest_counts),
        Step("emulator", "the kernels' MLX-generated source built with clang++ and run in the SIMT emulator "
             "(and the dispatch tests)", [py, "-m", "pytest", "-q", *EMULATOR_TESTS], parse=_pytest_counts),
        Step("metal_compile", "`xcrun metal` on the kernels' full source (MLX's utils.h prepended)",
             _metal_compile(py, work), skip=_xcrun_metal()),
        Step("attention_timing", "one layer's decode attention, kernel vs gather + SDPA, batch 1 and 8",
             ["bash", "-c", f'"{py}" scripts/bench/attention.py --contexts {TIMING_CONTEXTS} --batch 1 && '
                            f'"{py}" scripts/bench/attention.py --contexts {TIMING_CONTEXTS} --batch 8'],
             skip=no_metal),
        Step("bench_embedded", "macinfer vs mlx-lm on the embedded SmolLM2-135M",
             [py, "-m", "macinfer", "bench", *bench, "--compare", "mlx-lm"], skip=no_metal, timeout=3600),
        Step("bench_catalog", f"macinfer vs mlx-lm on {catalog or 'a catalog model on disk'}",
             [py, "-m", "macinfer", "bench", catalog or "MODEL", *bench, "--compare", "mlx-lm"],
             skip=no_metal or (None if catalog else "no catalog model on disk (`macinfer ls`); nothing is downloaded"),
             timeout=3600),
    ]


def run_step(step: Step) -> dict:
    result = {"name": step.name, "what": step.what, "command": " ".join(step.cmd)}
    if step.skip:
        return {**result, "status": "skipped", "reason": step.skip}
    print(f"== {step.name}: {step.what}", flush=True)
    t0 = time.time()
    try:
        p = subprocess.run(step.cmd, cwd=ROOT, capture_output=True, text=True, timeout=step.timeout)
        out, code = p.stdout, p.returncode
        err = p.stderr
    except subprocess.TimeoutExpired as e:
        out, code, err = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), -1, \
            f"timed out after {step.timeout} s"
    result.update(status="ran" if code == 0 else "failed", exit_code=code, seconds=round(time.time() - t0, 1),
                  output=out[-20000:], stderr=err[-4000:])
    if step.parse:
        try:
            result["figures"] = step.parse(out)
        except (ValueError, IndexError, KeyError):
            pass
    print(f"   {result['status']} ({result['seconds']} s)", flush=True)
    return result


def markdown(report: dict) -> str:
    lines = [f"# macinfer mac_check, {report['date']}", "",
             f"{report['host']['machine']} {report['host']['os']}, Python {report['host']['python']}, "
             f"Metal: {'yes' if report['metal'] else 'no'}, macinfer at {report['commit']}", ""]
    for r in report["steps"]:
        lines += [f"## {r['name']}: {r['status']}", "", r["what"], "", f"`{r['command']}`", ""]
        if r["status"] == "skipped":
            lines += [f"skipped: {r['reason']}", ""]
            continue
        if r["name"] == "doctor" and isinstance(r.get("figures"), dict):
            for c in r["figures"].get("checks", []):
                lines.append(f"- {c['name']} **{c['status']}**: {c.get('summary') or c.get('reason')}")
            lines.append("")
            continue
        body = (r.get("output") or "").strip().splitlines()[-40:]
        if r["status"] == "failed" and r.get("stderr"):
            body += ["", "stderr:"] + r["stderr"].strip().splitlines()[-20:]
        lines += ["```", *body, "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", default=sys.executable, help="the interpreter macinfer is installed in")
    p.add_argument("--dry-run", action="store_true", help="print every step's command; run nothing")
    p.add_argument("--quick", action="store_true", help="doctor --quick, one bench repeat")
    p.add_argument("--out", default=str(ROOT / "mac_check_report"), help="where the report goes")
    a = p.parse_args(argv)
    work = Path(tempfile.gettempdir()) / "mac_check_XXXX" if a.dry_run else Path(tempfile.mkdtemp(prefix="mac_check_"))
    metal = _metal(a.python)
    plan = steps(a.python, metal, work, a.quick)
    if a.dry_run:
        for s in plan:
            print(f"+ [{s.name}] {' '.join(s.cmd)}" + (f"    # on this host: skipped ({s.skip})" if s.skip else ""))
        print(f"+ [report] {a.out}/mac_check-<date>.md and .json")
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    report = {"mac_check": 1, "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "metal": metal,
              "commit": commit.strip() or "?",
              "host": {"machine": platform.machine(), "os": platform.platform(terse=True),
                       "python": platform.python_version()},
              "steps": [run_step(s) for s in plan]}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"mac_check-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text(markdown(report))
    skipped = [r["name"] for r in report["steps"] if r["status"] == "skipped"]
    failed = [r["name"] for r in report["steps"] if r["status"] == "failed"]
    print(f"skipped here: {', '.join(skipped) or 'nothing'}; failed: {', '.join(failed) or 'nothing'}")
    print(f"report: {stem}.md (and .json): attach both to an issue")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
