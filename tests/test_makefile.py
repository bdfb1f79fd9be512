"""`make test`, `make screenshots` and the benchmarks after the README's first command
(the gateway installed alone): each says which extra to install, never a bare
"No module named pytest"."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter with none of the extras (a virtualenv without even pip: quick to make)."""
    where = tmp_path_factory.mktemp("bare-venv")
    venv.EnvBuilder(with_pip=False).create(where)
    return str(where / "bin" / "python")


@pytest.mark.parametrize(("target", "extra"), [("test", "'.[test]'"), ("screenshots", "'.[test]'"),
                                               ("bench", "'.[test,bench]'"), ("soak", "'.[test,bench]'")])
def test_a_target_names_the_extra_it_needs(bare_python: str, target: str, extra: str) -> None:
    make = shutil.which("make")
    assert make is not None, "make is not installed"
    done = subprocess.run([make, "--no-print-directory", "-C", str(ROOT), target, f"PYTHON={bare_python}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"make {target} needs" in done.stderr and f"{bare_python} -m pip install -e {extra}" in done.stderr, \
        done.stdout + done.stderr
    assert "No module named" not in done.stdout + done.stderr


def test_make_test_runs_pytest_when_the_extra_is_there() -> None:
    make = shutil.which("make")
    assert make is not None
    done = subprocess.run([make, "--no-print-directory", "-n", "-C", str(ROOT), "test", f"PYTHON={sys.executable}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"{sys.executable} -m pytest -q -n 3" in done.stdout
