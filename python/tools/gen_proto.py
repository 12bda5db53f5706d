"""Regenerate the checked-in gRPC stubs from ../proto.

Usage (from the repository root or anywhere):

    python python/tools/gen_proto.py            # rewrite stepwatch/_proto
    python python/tools/gen_proto.py OUT_DIR    # write into OUT_DIR instead

Why two generators. Protobuf supports code generated for major version V on
runtimes V and V+1 only, and never on a runtime older than the protoc that
made it (https://protobuf.dev/support/cross-version-runtime-guarantee/). ML
environments pin anything from protobuf 4.21 to 6.x, which no one gencode
covers, so two are checked in and ``ingest_pb2.py`` (written by hand, copied
into an OUT_DIR) imports the one made for the runtime in use:

    ingest_pb2_v4.py  grpcio-tools 1.51.3 (protoc 3.21): protobuf 4.21.6 .. 5.x
    ingest_pb2_v6.py  grpcio-tools 1.72.1 (protoc 30):   protobuf 6.30 .. 7.x

``ingest_pb2_grpc.py`` comes from grpcio-tools 1.51.3: its stub has no grpcio
version check (later ones refuse a grpcio older than themselves), and what it
calls (``channel.stream_stream``) every grpcio since 1.0 has. The type stub
``ingest_pb2.pyi`` comes from the newer generator.

Each generator runs in a virtualenv of its own under
``~/.cache/stepwatch/venvs/`` (``$STEPWATCH_VENVS_DIR``), made with pip
on first use: their protobuf requirements conflict with each other and with
the runtime under test. Protoc's output does not depend on the Python that
runs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY_ROOT = HERE.parent
PROTO_ROOT = PY_ROOT.parent / "proto"
PROTO = "stepwatch/v1/ingest.proto"
DEFAULT_OUT = PY_ROOT / "stepwatch" / "_proto"

# The generators, by the gencode suffix they make (see the module docstring).
OLD_TOOLS = "1.51.3"  # gencode for protobuf 4.x (runs on 4.21.6 .. 5.x); the gRPC stub
NEW_TOOLS = "1.72.1"  # gencode for protobuf 6.30 (runs on 6.x .. 7.x); the .pyi


class VenvUnavailable(RuntimeError):
    """A throwaway virtualenv could not be made; ``offline`` when pip could not
    reach the package index (the one case tests skip for)."""

    def __init__(self, message: str, offline: bool) -> None:
        super().__init__(message)
        self.offline = offline


# What pip says when it cannot reach the index (urllib3/requests wording).
_OFFLINE_HINTS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "ConnectTimeoutError",
    "ProxyError",
)


def throwaway_venv(name: str, specs: list[str], probe: str) -> Path:
    """The Python of a virtualenv ``name`` under ``~/.cache/stepwatch/venvs``
    (``$STEPWATCH_VENVS_DIR``) holding exactly ``specs`` (pip requirement
    strings), made on first use with ``$STEPWATCH_VENV_PYTHON`` (default: this
    Python) and kept; ``probe`` (Python code) must run in it for it to count
    as made. Raises :class:`VenvUnavailable`."""
    root = Path(
        os.environ.get("STEPWATCH_VENVS_DIR") or Path.home() / ".cache" / "stepwatch" / "venvs"
    )
    venv = root / name
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", probe]).returncode == 0:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    # grpcio 1.51.3 (generator and compat pin) has wheels up to CPython 3.11.
    base = os.environ.get("STEPWATCH_VENV_PYTHON") or sys.executable
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    done = subprocess.run(
        [*pip, "--retries", "1", "--timeout", "15", *specs], capture_output=True, text=True
    )
    if done.returncode != 0 or subprocess.run([str(python), "-c", probe]).returncode != 0:
        shutil.rmtree(venv, ignore_errors=True)
        offline = any(hint in done.stderr for hint in _OFFLINE_HINTS)
        raise VenvUnavailable(
            f"could not install {' '.join(specs)} into {venv}: {done.stderr.strip()[-2000:]}",
            offline,
        )
    return python


def _generator_python(version: str) -> Path:
    """The Python of a virtualenv holding grpcio-tools ``version``."""
    return throwaway_venv(
        f"grpcio-tools-{version}", [f"grpcio-tools=={version}"], "import grpc_tools.protoc"
    )


def _protoc(version: str, out: Path, *outputs: str) -> None:
    """Run grpcio-tools ``version``'s protoc on the contract into ``out``."""
    python = _generator_python(version)
    args = [f"--{o}_out={out}" for o in outputs]
    cmd = [str(python), "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}", *args, PROTO]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"protoc (grpcio-tools {version}) failed: {done.stderr}")


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs into ``out_dir``; return the files written."""
    pkg = Path(PROTO).parent
    stem = Path(PROTO).stem
    with tempfile.TemporaryDirectory() as tmp:
        old, new = Path(tmp) / "old", Path(tmp) / "new"
        old.mkdir()
        new.mkdir()
        _protoc(OLD_TOOLS, old, "python", "grpc_python")
        _protoc(NEW_TOOLS, new, "python", "pyi")
        dest = out_dir / pkg
        dest.mkdir(parents=True, exist_ok=True)
        # Make every level a package so the stubs import package-relatively.
        d = out_dir
        for part in ("", *pkg.parts):
            d = d / part if part else d
            init = d / "__init__.py"
            if not init.exists():
                init.write_text("")
        written = {
            dest / f"{stem}_pb2_v4.py": (old / pkg / f"{stem}_pb2.py").read_text(),
            dest / f"{stem}_pb2_v6.py": (new / pkg / f"{stem}_pb2.py").read_text(),
            dest / f"{stem}_pb2.pyi": (new / pkg / f"{stem}_pb2.pyi").read_text(),
        }
        grpc_text = (old / pkg / f"{stem}_pb2_grpc.py").read_text()
    # "from stepwatch.v1 import ingest_pb2 as ..." -> "from . import ingest_pb2 as ..."
    module = ".".join(pkg.parts)
    grpc_text = re.sub(
        rf"^from {re.escape(module)} import ", "from . import ", grpc_text, flags=re.M
    )
    written[dest / f"{stem}_pb2_grpc.py"] = grpc_text
    for path, text in written.items():
        path.write_text(text)
    dispatcher = DEFAULT_OUT / pkg / f"{stem}_pb2.py"
    if dest / dispatcher.name != dispatcher:
        shutil.copyfile(dispatcher, dest / dispatcher.name)
    return sorted(written)


def main(argv: list[str]) -> int:
    out = Path(argv[1]).resolve() if len(argv) > 1 else DEFAULT_OUT
    for path in generate(out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
