"""The built wheel works on its own: installed in a fresh venv, it finds its catalog and shipped drafts.

A wheel (or pipx) install has no source checkout beside it, so everything under models/ must
ship inside the package (pyproject.toml maps it to macinfer/_models).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_runs_draft_auto_in_a_fresh_venv(tmp_path):
    # 1. Build the wheel (isolated build: setuptools from the package index, as any user gets it).
    # From a copy: setuptools writes build/ and *.egg-info into the tree it builds.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".pytest_cache"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"),
                            str(src)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("macinfer-*.whl"))
    # 2. A fresh venv that sees the installed dependencies but not this checkout.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    bin_dir = env_dir / "bin"
    # Without the PYTHONPATH the tests give child processes (conftest.py): through it pip would see
    # this checkout's macinfer as installed already and skip the wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                         capture_output=True, text=True, env=env)
    assert pip.returncode == 0, pip.stderr[-2000:]
    probe = ("import macinfer.paths as p, macinfer.spec_decode.speculator as s; "
             "print(p.models_dir()); print(s.shipped_draft_for('smollm2-135m'))")
    where = subprocess.run([str(bin_dir / "python"), "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    models, draft = (where.stdout.strip().splitlines() + ["", ""])[:2]
    models = Path(models)
    assert draft == "smollm2-135m", where.stdout + where.stderr  # --draft auto finds the shipped draft
    assert models.is_relative_to(env_dir) and (models / "catalog.json").is_file(), where.stdout + where.stderr
    assert (models / "smollm2-135m-eagle" / "model.safetensors").is_file()
    # 3. The installed command, outside the checkout, with the shipped feature draft.
    run = subprocess.run([str(bin_dir / "macinfer"), "run", "What is the capital of France?", "--draft", "auto",
                          "-n", "6", "--json"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "Paris" in out["text"] and out["generation_tokens"] == 6
