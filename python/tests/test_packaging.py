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


def _project():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads(PYPROJECT.read_text())["project"]


def _floors(requirements):
    """{name: floor} of requirements written ``name>=floor[,...]``."""
    out = {}
    for req in requirements:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?>=([0-9.]+)(,.*)?", req)
        assert m, f"{req!r} states no floor"
        out[m.group(1)] = m.group(3)
    return out


def test_the_lightning_and_transformers_extras_are_declared_with_floors():
    extras = _project()["optional-dependencies"]
    lightning = _floors(extras["lightning"])
    assert lightning == {"lightning": "2.0"}, lightning
    transformers = _floors(extras["transformers"])
    assert set(transformers) == {"transformers", "accelerate", "torch"}, transformers
    # The base install stays free of them.
    base = _floors(_project()["dependencies"])
    assert set(base) == {"grpcio", "protobuf"}, base


def test_the_runtime_floors_are_the_ones_the_compat_test_runs_on():
    """pyproject's protobuf and grpcio floors are the oldest pins
    test_protobuf_compat.py proves the client on."""
    from test_protobuf_compat import CASES

    base = _floors(_project()["dependencies"])
    pinned = {}
    for specs in CASES.values():
        for spec in specs:
            name, version = spec.split("==")
            old = pinned.get(name)
            key = tuple(int(n) for n in version.split("."))
            if old is None or key < tuple(int(n) for n in old.split(".")):
                pinned[name] = version
    assert base == pinned, (base, pinned)
