"""scripts/install.sh picks where to install without tripping PEP 668, checked with --dry-run.

An externally managed Python is made for real: the running interpreter with PYTHONHOME pointing
at a copy of its stdlib directory (symlinks) that holds an EXTERNALLY-MANAGED marker, so pip
itself refuses to install into it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE_PYTHON = os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _install(tmp_path, *args, python=BASE_PYTHON, pythonhome=None, path_first=()):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV", "PYTHON")}
    env.update(PYTHON=python, HOME=str(tmp_path / "home"), PATH=os.pathsep.join([*map(str, path_first), env["PATH"]]))
    if pythonhome:
        env["PYTHONHOME"] = str(pythonhome)
    return subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "--dry-run", *args],
                          capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture
def managed_home(tmp_path):
    """A PYTHONHOME whose stdlib is the real one plus PEP 668's EXTERNALLY-MANAGED marker."""
    stdlib = Path(sysconfig.get_paths(vars={"installed_base": sys.base_prefix, "base": sys.base_prefix})["stdlib"])
    home = tmp_path / "managed"
    lib = home / stdlib.relative_to(sys.base_prefix)
    lib.mkdir(parents=True)
    for entry in stdlib.iterdir():
        if entry.name != "EXTERNALLY-MANAGED":
            (lib / entry.name).symlink_to(entry)
    (lib / "EXTERNALLY-MANAGED").write_text("[externally-managed]\nError=use a venv\n")
    return home


def test_marker_makes_pip_refuse(tmp_path, managed_home):
    # The oracle: the fake home is externally managed in pip's own eyes.
    env = {**os.environ, "PYTHONHOME": str(managed_home)}
    env.pop("VIRTUAL_ENV", None)
    pip = subprocess.run([BASE_PYTHON, "-m", "pip", "install", "--dry-run", "--no-index", "nothing-here"],
                         capture_output=True, text=True, env=env, timeout=60)
    if "No module named pip" in pip.stderr:
        pytest.skip("the base interpreter has no pip of its own")
    assert pip.returncode != 0 and "externally-managed-environment" in pip.stderr


def test_externally_managed_user_install_goes_into_a_venv(tmp_path, managed_home):
    local_bin = tmp_path / "home" / ".local" / "bin"
    local_bin.mkdir(parents=True)
    out = _install(tmp_path, pythonhome=managed_home, path_first=[local_bin])
    assert out.returncode == 0, out.stderr
    assert "strategy: venv" in out.stdout
    lines = out.stdout.splitlines()
    assert f"+ {BASE_PYTHON} -m venv .venv" in lines
    assert "+ .venv/bin/python -m pip install -q --disable-pip-version-check -e ." in lines
    assert "--break-system-packages" not in out.stdout
    assert f"+ ln -sf {ROOT}/.venv/bin/macinfer {local_bin}/macinfer" in lines
    assert lines[-1] == 'macinfer installed: try  macinfer run "What is the capital of France?"'
    assert "pyenv rehash" not in out.stdout  # the venv's own command, not a pyenv shim


def test_venv_command_goes_on_the_path_a_user_may_write_to(tmp_path, managed_home):
    """No ~/.local/bin on the PATH: a writable directory that is (Homebrew's bin on a Mac), else a note."""
    brew_bin = tmp_path / "brew-bin"  # stands for /opt/homebrew/bin: on the PATH, writable
    brew_bin.mkdir()
    env_path = [p for p in os.environ["PATH"].split(os.pathsep) if p not in ("/opt/homebrew/bin", "/usr/local/bin")]
    script = (ROOT / "scripts" / "install.sh").read_text().replace("/opt/homebrew/bin", str(brew_bin))
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "install.sh").write_text(script)  # it installs the checkout it sits in: tmp_path
    env = {**{k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHON")},
           "PYTHON": BASE_PYTHON, "PYTHONHOME": str(managed_home), "HOME": str(tmp_path / "home")}
    for path, where, note in ((f"{brew_bin}:" + os.pathsep.join(env_path), brew_bin, False),
                              (os.pathsep.join(env_path), tmp_path / "home" / ".local" / "bin", True)):
        out = subprocess.run(["bash", str(tmp_path / "scripts" / "install.sh"), "--dry-run"], capture_output=True,
                             text=True, env={**env, "PATH": path}, timeout=60)
        assert out.returncode == 0, out.stderr
        assert f"+ ln -sf {tmp_path}/.venv/bin/macinfer {where}/macinfer" in out.stdout.splitlines()
        assert ("not on your PATH" in out.stdout) is note
        assert out.stdout.splitlines()[-1].endswith(
            f'try  {tmp_path}/.venv/bin/macinfer run "What is the capital of France?"' if note else
            'try  macinfer run "What is the capital of France?"')


@pytest.mark.skipif(os.geteuid() != 0, reason="the CI path: --test as root")
def test_externally_managed_test_install_as_root_keeps_python3(tmp_path, managed_home):
    out = _install(tmp_path, "--test", pythonhome=managed_home)
    assert out.returncode == 0, out.stderr
    assert "strategy: pip-system" in out.stdout
    expected = f"+ {BASE_PYTHON} -m pip install -q --disable-pip-version-check --break-system-packages -e .[test]"
    assert expected in out.stdout.splitlines()
    assert "-m venv" not in out.stdout


def test_unmanaged_python_installs_into_itself(tmp_path):
    out = _install(tmp_path, "--test")
    assert out.returncode == 0, out.stderr
    assert "strategy: pip (" in out.stdout
    assert f"+ {BASE_PYTHON} -m pip install -q --disable-pip-version-check -e .[test]" in out.stdout.splitlines()
    assert "-m venv" not in out.stdout and "--break-system-packages" not in out.stdout


def test_python_below_310_is_refused_in_one_line(tmp_path):
    old = tmp_path / "python3.9"  # answers the script's probe as Xcode's python3 would
    old.write_text('#!/bin/sh\ncat >/dev/null\necho "3.9 0 0"\n')
    old.chmod(0o755)
    out = _install(tmp_path, python=str(old))
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "Python 3.9" in out.stderr and "brew install python@3.12" in out.stderr
