"""pyproject.toml in the form setuptools requires from 2027-02 (PEP 639): the license as an
SPDX expression with its files named, and a setuptools that reads it. (`pip install -e .`
in a fresh virtualenv builds it; that needs PyPI, so it is not run here.)"""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def test_the_license_is_an_spdx_expression_with_its_files() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT"  # a string, not the deprecated {text = …} table
    files = project["project"]["license-files"]
    assert files and all(list(ROOT.glob(pattern)) for pattern in files), files
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    classifiers = project["project"].get("classifiers", [])
    assert not [c for c in classifiers if c.startswith("License ::")]  # PEP 639 forbids both
    setuptools = next(Requirement(r) for r in project["build-system"]["requires"]
                      if Requirement(r).name == "setuptools")
    # Versions before 77 cannot read `license` as a string; every allowed one can.
    assert not setuptools.specifier.contains(Version("76.9")) and setuptools.specifier.contains(Version("77.0"))
    # The image installs the package from its copied files: the license must be among them.
    assert "COPY pyproject.toml README.md LICENSE ./" in (ROOT / "docker" / "Dockerfile").read_text()
