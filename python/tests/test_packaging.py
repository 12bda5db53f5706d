"""The package's metadata: one version string, read by setuptools from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import stepwatch
from stepwatch import _version

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_the_version_is_written_once_in_the_code():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads(PYPROJECT.read_text())
    assert "version" not in project["project"], "a second version string in pyproject.toml"
    assert "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "stepwatch._version.__version__"
    assert stepwatch.__version__ == _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", _version.__version__)
