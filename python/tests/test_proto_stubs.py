"""The checked-in stubs must be what tools/gen_proto.py makes from proto/ today."""

import importlib.util
import sys
from pathlib import Path

import pytest

PY_ROOT = Path(__file__).resolve().parent.parent
CHECKED_IN = PY_ROOT / "stepwatch" / "_proto"
PROTO = PY_ROOT.parent / "proto" / "stepwatch" / "v1" / "ingest.proto"


def load_generator():
    """tools/gen_proto.py as a module (also for test_protobuf_compat's venvs)."""
    if "gen_proto" in sys.modules:
        return sys.modules["gen_proto"]
    spec = importlib.util.spec_from_file_location("gen_proto", PY_ROOT / "tools" / "gen_proto.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_checked_in_stubs_are_fresh(tmp_path):
    assert PROTO.exists(), f"wire contract not found at {PROTO}"
    gen = load_generator()
    try:
        written = gen.generate(tmp_path)
    except gen.VenvUnavailable as e:
        if e.offline:
            pytest.skip(f"the package index is unreachable, so the generators cannot be had: {e}")
        raise
    assert written
    stale = []
    for fresh in sorted(tmp_path.rglob("*")):
        if fresh.is_dir():
            continue
        rel = fresh.relative_to(tmp_path)
        mine = CHECKED_IN / rel
        if not mine.exists() or mine.read_bytes() != fresh.read_bytes():
            stale.append(str(rel))
    assert not stale, (
        f"checked-in stubs differ from proto/: {stale}; run `python python/tools/gen_proto.py`"
    )


def test_stubs_import_package_relative_and_carry_no_version_check():
    """The gRPC stub names no grpcio version (grpcio-tools >= 1.63 write a check
    that refuses any older grpcio), and the messages come from the gencode made
    for this runtime."""
    text = (CHECKED_IN / "stepwatch" / "v1" / "ingest_pb2_grpc.py").read_text()
    assert "from . import ingest_pb2" in text
    assert "GRPC_GENERATED_VERSION" not in text
    v4 = (CHECKED_IN / "stepwatch" / "v1" / "ingest_pb2_v4.py").read_text()
    assert "runtime_version" not in v4
    import google.protobuf

    from stepwatch._proto.stepwatch.v1 import ingest_pb2, ingest_pb2_grpc

    assert ingest_pb2.DESCRIPTOR.package == "stepwatch.v1"
    assert ingest_pb2.Hello(run_id="r").run_id == "r"
    assert hasattr(ingest_pb2_grpc, "IngestStub")
    major = int(google.protobuf.__version__.split(".")[0])
    chosen = "ingest_pb2_v6" if major >= 6 else "ingest_pb2_v4"
    assert f"stepwatch._proto.stepwatch.v1.{chosen}" in sys.modules
