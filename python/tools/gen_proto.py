"""Regenerate the checked-in gRPC stubs from ../proto.

Usage (from the repository root or anywhere):

    python python/tools/gen_proto.py            # rewrite stepwatch/_proto
    python python/tools/gen_proto.py OUT_DIR    # write into OUT_DIR instead

Needs grpcio-tools at the version pinned in pyproject.toml's ``test`` extra
(the generated code records the grpcio/protobuf versions it was made with).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY_ROOT = HERE.parent
PROTO_ROOT = PY_ROOT.parent / "proto"
PROTOS = ["stepwatch/v1/ingest.proto"]
DEFAULT_OUT = PY_ROOT / "stepwatch" / "_proto"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) into ``out_dir``; return the files written."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTOS,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    written = []
    for proto in PROTOS:
        pkg_dir = out_dir / Path(proto).parent
        # Make every level a package so the stubs import package-relatively.
        d = out_dir
        for part in ("", *Path(proto).parent.parts):
            d = d / part if part else d
            init = d / "__init__.py"
            if not init.exists():
                init.write_text("")
        stem = Path(proto).stem
        grpc_file = pkg_dir / f"{stem}_pb2_grpc.py"
        text = grpc_file.read_text()
        # "from stepwatch.v1 import ingest_pb2 as ..." -> "from . import ingest_pb2 as ..."
        module = ".".join(Path(proto).parent.parts)
        text = re.sub(rf"^from {re.escape(module)} import ", "from . import ", text, flags=re.M)
        grpc_file.write_text(text)
        written += [pkg_dir / f"{stem}_pb2.py", pkg_dir / f"{stem}_pb2.pyi", grpc_file]
    return written


def main(argv: list[str]) -> int:
    out = Path(argv[1]).resolve() if len(argv) > 1 else DEFAULT_OUT
    for path in generate(out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
