"""The checked-in stubs must be what grpcio-tools makes from proto/ today."""

import importlib.util
import sys
from pathlib import Path

import pytest

PY_ROOT = Path(__file__).resolve().parent.parent
CHECKED_IN = PY_ROOT / "stepwatch" / "_proto"
PROTO = PY_ROOT.parent / "proto" / "stepwatch" / "v1" / "ingest.proto"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_proto", PY_ROOT / "tools" / "gen_proto.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_checked_in_stubs_are_fresh(tmp_path):
    assert PROTO.exists(), f"wire contract not found at {PROTO}"
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the [test] extra")
    gen = _load_generator()
    gen.generate(tmp_path)
    stale = []
    for fresh in sorted(tmp_path.rglob("*")):
        if fresh.is_dir():
            continue
        rel = fresh.relative_to(tmp_path)
        mine = CHECKED_IN / rel
        if not mine.exists() or mine.read_bytes() != fresh.read_bytes():
            stale.append(str(rel))
    assert not stale, (
        f"checked-in stubs differ from proto/: {stale}; run `python python/tools/gen_proto.py` "
        "with the grpcio-tools version pinned in python/pyproject.toml"
    )


def test_stubs_import_package_relative():
    text = (CHECKED_IN / "stepwatch" / "v1" / "ingest_pb2_grpc.py").read_text()
    assert "from . import ingest_pb2" in text
    from stepwatch._proto.stepwatch.v1 import ingest_pb2, ingest_pb2_grpc

    assert ingest_pb2.DESCRIPTOR.package == "stepwatch.v1"
    assert hasattr(ingest_pb2_grpc, "IngestStub")
