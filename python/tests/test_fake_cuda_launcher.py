"""stepwatch.fake_cuda's build outside a checkout: what a missing tool or torch
says, and when a build in the cache is reused."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from stepwatch import fake_cuda


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("STEPWATCH_FAKE_CUDA_CACHE", str(root))
    return root


def fake_torch(tmp_path: Path, version: str) -> Path:
    """A folder with a `torch` package that find_spec sees (never imported)."""
    pkg = tmp_path / "site" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('not imported by the launcher')\n")
    (pkg / "version.py").write_text(f"__version__ = '{version}'\n")
    return pkg.parent


def test_the_sources_ship_with_the_package():
    names = sorted(p.name for p in fake_cuda.SRC.glob("*.c"))
    assert names == ["cublas.c", "cudart.c", "libcuda.c", "nccl.c"], names


def test_the_cache_is_per_torch_version_under_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("STEPWATCH_FAKE_CUDA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = fake_cuda.build_dir("2.15.0+cu132")
    assert out == tmp_path / "stepwatch" / "fake-cuda" / "2.15.0+cu132"


def test_a_missing_compiler_or_nm_is_named(cache, tmp_path, monkeypatch, capsys):
    site = fake_torch(tmp_path, "2.15.0+cu132")
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setattr(fake_cuda.shutil, "which", lambda tool: None)
    with pytest.raises(SystemExit) as end:
        fake_cuda.build(sys.executable)
    assert end.value.code == 2
    err = capsys.readouterr().err
    assert "needs gcc and nm, not found on PATH" in err, err
    assert "apt-get install gcc binutils" in err, err
    assert not (cache / "2.15.0+cu132").exists()


def test_a_cpu_only_torch_is_named(cache, tmp_path, monkeypatch, capsys):
    site = fake_torch(tmp_path, "2.15.0+cpu")
    monkeypatch.setenv("PYTHONPATH", str(site))
    with pytest.raises(SystemExit):
        fake_cuda.build(sys.executable)
    err = capsys.readouterr().err
    assert "2.15.0+cpu" in err and "CPU-only build" in err and "CUDA build of torch" in err, err


def test_a_python_without_torch_is_named(cache, tmp_path, capsys):
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    bare.chmod(0o755)
    with pytest.raises(SystemExit):
        fake_cuda.build(str(bare))
    err = capsys.readouterr().err
    assert "has no torch" in err and "CUDA build of torch" in err, err


def test_a_build_is_reused_until_its_sources_change(cache):
    out = fake_cuda.build_dir("2.15.0+cu132")
    assert fake_cuda.stale(out)
    out.mkdir(parents=True)
    (out / "built").write_text(f"torch 2.15.0+cu132\nsources {fake_cuda.sources_digest()}\n")
    assert not fake_cuda.stale(out)
    (out / "built").write_text("torch 2.15.0+cu132\nsources 0000\n")
    assert fake_cuda.stale(out)


def test_the_stepwatch_binary_comes_from_path(monkeypatch, tmp_path):
    binary = tmp_path / "bin" / "stepwatch"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.delenv("STEPWATCH_BIN", raising=False)
    monkeypatch.setattr(fake_cuda, "REPO", None)
    monkeypatch.setenv("PATH", str(binary.parent) + os.pathsep + os.environ.get("PATH", ""))
    assert fake_cuda.stepwatch_binary() == binary
