"""fake-cuda: unmodified PyTorch on simulated GPUs, with no GPU.

    python -m stepwatch.fake_cuda run [--gpus N] [--gpu-capacity 48GiB] [--context 512MiB]
                  [--usage-log DIR] [--python PY] -- python train.py ...
    python -m stepwatch.fake_cuda build [--python PY]   # build the libraries for PY's torch
    python -m stepwatch.fake_cuda info  [--python PY]   # where they are, what they stand in for

(`crates/fake-cuda/fake-cuda` in a checkout.) `run` builds, once per installed
torch, five small stand-in libraries -- libcudart.so.13, libcublas.so.13,
libcublasLt.so.13, libcuda.so.1 and libnccl.so.2 -- from the C sources that
ship with this package (csrc/), with gcc and nm, into
~/.cache/stepwatch/fake-cuda/<torch version>/, preloads them, and points them
at fake-nvml GPUs: PyTorch's real caching allocator, autograd, optimizers,
DDP/FSDP over a fake NCCL and torch.OutOfMemoryError all run; kernels do
nothing. Each process charges a CUDA context plus what it cudaMallocs to its
fake-nvml process slot, so `stepwatch agent` (and nvidia-smi-like readers of
fake-nvml) see exactly what PyTorch reserved. The fake NVML library comes
from the stepwatch binary ($STEPWATCH_BIN, else `stepwatch` on PATH). See
crates/fake-cuda/README.md of the repository.

Standard library only: the checkout's launcher runs this file without
importing the stepwatch package.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn, Optional

HERE = Path(__file__).resolve().parent
SRC = HERE / "csrc"
# python/stepwatch/fake_cuda in a checkout: its target/ holds the dev binary.
REPO = HERE.parents[2] if (HERE.parents[2] / "Cargo.toml").is_file() else None
NVML_ENV = "STEPWATCH_FAKE_NVML_DIR"
UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})

LIMITS = """\
fake-cuda: kernels do nothing, only memory is real. Not available: cuDNN
  (torch.backends.cudnn.enabled = False; torch.backends.cuda.enable_cudnn_sdp(False)),
  CUDA graphs, torch.compile/Triton, the cudaMallocAsync allocator backend.
  Kernel results are zeros or stale (loss.item() == 0.0): data-dependent sizes are wrong."""


def log(msg: str) -> None:
    print(f"fake-cuda: {msg}", file=sys.stderr, flush=True)


def die(msg: str, code: int = 2) -> NoReturn:
    log(f"error: {msg}")
    sys.exit(code)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a size (e.g. 48GiB, 512MiB, 80GB, or bytes)"
        )
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def parse_duration(text: str) -> int:
    """'50us', '1ms', '2s' or nanoseconds, as nanoseconds."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ns|us|ms|s)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"'{text}' is not a duration (e.g. 50us, 1ms)")
    scale = {None: 1, "ns": 1, "us": 10**3, "ms": 10**6, "s": 10**9}[m.group(2)]
    return int(float(m.group(1)) * scale)


# ------------------------------------------------------------------ build
def default_python(cmd: list[str]) -> str:
    """The Python whose torch the libraries must match: the command's own
    interpreter when it is one, else the test venv's, else python3."""
    if cmd and Path(cmd[0]).name.startswith("python"):
        found = shutil.which(cmd[0])
        if found:
            return found
    if REPO is not None:
        venv = Path(os.environ.get("STEPWATCH_PY_VENV", Path.home() / ".cache/stepwatch/py-venv"))
        if (venv / "bin/python").exists():
            return str(venv / "bin/python")
    return sys.executable


def torch_location(python: str) -> tuple[Path, str]:
    """torch's folder and version for `python`, without importing torch (that
    takes seconds of CPU, paid on every `run`): its spec and its version.py."""
    code = (
        "import importlib.util, os, re; s = importlib.util.find_spec('torch'); "
        "d = os.path.dirname(s.origin); "
        "v = re.search(r\"__version__ = '([^']+)'\", open(os.path.join(d, 'version.py')).read()); "
        "print(d); print(v.group(1))"
    )
    r = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        die(
            f"{python} has no torch (or an unreadable torch/version.py): install the CUDA build "
            f"of torch for it (the default on PyPI)\n{r.stderr.strip()}"
        )
    torch_dir, version = r.stdout.strip().splitlines()[-2:]
    if "+cpu" in version:
        die(
            f"torch {version} in {torch_dir} is a CPU-only build: fake-cuda needs a CUDA "
            "build of torch (the default on PyPI), whose libraries it stands in for"
        )
    return Path(torch_dir), version


def undefined_symbols(libs: list[Path]) -> list[str]:
    if not libs:
        return []
    r = subprocess.run(
        ["nm", "-D", "--undefined-only", *map(str, libs)], capture_output=True, text=True
    )
    out = []
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "U":
            out.append(parts[1])
    return out


def defined_symbols(obj: Path) -> set[str]:
    r = subprocess.run(["nm", "--defined-only", "-g", str(obj)], capture_output=True, text=True)
    return {ln.split()[-1] for ln in r.stdout.splitlines() if len(ln.split()) >= 3}


def imported(torch_dir: Path) -> dict[str, set[str]]:
    """What torch's libraries (and cuSOLVER, for torch.linalg) import from each
    library this stands in for: {soname: {symbol}}. Versioned symbols carry
    their library's version node, which is also its SONAME."""
    site = torch_dir.parent
    libs = sorted((torch_dir / "lib").glob("*.so"))
    libs += sorted(site.glob("nvidia/cu*/lib/libcusolver*.so*"))
    by_lib: dict[str, set[str]] = {}
    for sym in undefined_symbols(libs):
        name, _, node = sym.partition("@")
        node = node.lstrip("@")
        if re.fullmatch(r"lib(cudart|cublas|cublasLt)\.so\.\d+", node):
            by_lib.setdefault(node, set()).add(name)
        elif not node and name.startswith("nccl"):
            by_lib.setdefault("libnccl.so.2", set()).add(name)
    nvrtc = torch_dir / "lib" / "libcaffe2_nvrtc.so"
    for sym in undefined_symbols([nvrtc] if nvrtc.exists() else []):
        name = sym.partition("@")[0]
        if re.match(r"cu[A-Z]", name):
            by_lib.setdefault("libcuda.so.1", set()).add(name)
    for need in ("libcudart.so.", "libcublas.so.", "libcublasLt.so."):
        if not any(k.startswith(need) for k in by_lib):
            die(f"torch in {torch_dir} imports nothing from {need}*: is it a CUDA build?")
    return by_lib


def include_dirs(torch_dir: Path) -> list[str]:
    site = torch_dir.parent
    cuda = [p.parent for p in site.glob("nvidia/cu*/include/cuda_runtime_api.h")]
    cuda += [p.parent for p in site.glob("nvidia/cuda_runtime/include/cuda_runtime_api.h")]
    if not cuda:
        die(
            f"no CUDA headers (nvidia/*/include/cuda_runtime_api.h) under {site}: they come "
            "with a CUDA build of torch from PyPI (its nvidia-cuda-runtime dependency)"
        )
    flags = [f"-I{cuda[0]}"]
    flags += [f"-I{p.parent}" for p in site.glob("nvidia/nccl/include/nccl.h")]
    # The wheel's headers lack crt/host_defines.h; Triton's bundled CUDA headers have it.
    flags += [
        f"-idirafter{p.parent.parent}"
        for p in site.glob("triton/backends/nvidia/include/crt/host_defines.h")
    ]
    return flags


def cache_root() -> Path:
    """$STEPWATCH_FAKE_CUDA_CACHE, else $XDG_CACHE_HOME/stepwatch/fake-cuda (~/.cache)."""
    given = os.environ.get("STEPWATCH_FAKE_CUDA_CACHE")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "stepwatch" / "fake-cuda"


def build_dir(version: str) -> Path:
    return cache_root() / re.sub(r"[^A-Za-z0-9_.+-]", "_", version)


def sources_digest() -> str:
    """What the libraries are built from: the C sources and this file. Installed
    files' times say nothing, so a build is stale when this differs."""
    h = hashlib.sha256()
    for p in sorted([*SRC.glob("*.c"), Path(__file__).resolve()]):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def stale(out: Path) -> bool:
    stamp = out / "built"
    return not stamp.exists() or f"sources {sources_digest()}" not in stamp.read_text()


def build(python: str, force: bool = False) -> Path:
    torch_dir, version = torch_location(python)
    out = build_dir(version)
    if not force and not stale(out):
        return out
    missing = [tool for tool in ("gcc", "nm") if not shutil.which(tool)]
    if missing:
        die(
            f"building the stand-in libraries for torch {version} needs {' and '.join(missing)}, "
            "not found on PATH (Debian/Ubuntu: apt-get install gcc binutils)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    # One build at a time per torch version; a process that waited uses the result.
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and not stale(out):
            return out
        shutil.rmtree(out, ignore_errors=True)
        build_into(out, torch_dir, version)
    return out


def build_into(out: Path, torch_dir: Path, version: str) -> None:
    log(f"building the stand-in libraries for torch {version} in {out} (once per torch)")
    out.mkdir(parents=True, exist_ok=True)
    by_lib = imported(torch_dir)
    # Stubs ignore most of their parameters, so unused ones are not flagged.
    cflags = ["-O2", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror"]
    cflags += ["-Wno-unused-parameter"]
    cflags += include_dirs(torch_dir)
    cudart = next(k for k in by_lib if k.startswith("libcudart."))
    cublas = next(k for k in by_lib if k.startswith("libcublas."))
    cublaslt = next(k for k in by_lib if k.startswith("libcublasLt."))
    plan = [  # soname, source, extra cflags, versioned, link with
        (cudart, "cudart.c", [], True, ["-ldl", "-lpthread"]),  # first: the others link to it
        (cublas, "cublas.c", [], True, [str(out / cudart)]),
        (cublaslt, "cublas.c", ["-DFAKE_CUBLASLT"], True, [str(out / cudart)]),
        ("libcuda.so.1", "libcuda.c", [], False, [str(out / cudart)]),
        ("libnccl.so.2", "nccl.c", [], False, [str(out / cudart)]),
    ]
    for soname, source, extra, versioned, link in plan:
        objs = []
        implemented: set[str] = set()
        if source:
            obj = out / f"{soname}.impl.o"
            run(["gcc", *cflags, *extra, "-c", str(SRC / source), "-o", str(obj)])
            implemented = defined_symbols(obj)
            objs.append(obj)
        wanted = by_lib.get(soname, set())
        stubs = sorted(wanted - implemented)
        stub_c = out / f"{soname}.stubs.c"
        stub_c.write_text(
            STUB_HEADER.format(count=len(stubs), soname=soname)
            + "".join(
                f'__attribute__((visibility("default"))) int {s}(void) '
                f'{{ trace("{s}");{" stepwatchFakeCudaKernel();" if KERNEL.search(s) else ""}'
                " return 0; }\n"
                for s in stubs
            )
        )
        stub_o = out / f"{soname}.stubs.o"
        run(["gcc", "-O2", "-fPIC", "-c", str(stub_c), "-o", str(stub_o)])
        objs.append(stub_o)
        exported = sorted(implemented | set(stubs))
        script = out / f"{soname}.map"
        node = soname if versioned else ""
        script.write_text(
            f"{node} {{\n  global:\n"
            + "".join(f"    {s};\n" for s in exported)
            + "  local: *;\n};\n"
        )
        run(
            [
                "gcc",
                "-shared",
                f"-Wl,-soname,{soname}",
                f"-Wl,--version-script={script}",
                "-o",
                str(out / soname),
                *map(str, objs),
                *link,
            ]
        )
        log(f"  {soname}: {len(implemented)} written, {len(stubs)} stubs")
    stamp = (
        f"torch {version}\n{torch_dir}\nsources {sources_digest()}\nby {Path(__file__).resolve()}\n"
    )
    (out / "built").write_text(stamp)


# cuBLAS calls that launch work on the device: they take --kernel-time each.
KERNEL = re.compile(
    r"^cublas(Lt)?(Matmul|.*[Gg]emm.*|.*[Gg]emv.*|[SDCZH]?(axpy|scal|dot|nrm2|trsm).*)$"
)

STUB_HEADER = """/* Generated by fake-cuda from torch's imports: {count} functions of {soname}
 * that succeed and do nothing. STEPWATCH_FAKE_CUDA_DEBUG=2 logs each call. */
#include <stdlib.h>
#include <stdio.h>
void stepwatchFakeCudaKernel(void); /* in the fake libcudart; no-op unless timed */
static void trace(const char *name) {{
  static int level = -1;
  if (level < 0) {{
    const char *v = getenv("STEPWATCH_FAKE_CUDA_DEBUG");
    level = v ? atoi(v) : 0;
  }}
  if (level >= 2) fprintf(stderr, "fake-cuda: stub {soname} %s\\n", name);
}}
"""


def run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        die(f"{' '.join(cmd[:3])} ... failed:\n{r.stderr.strip()}", code=1)


# -------------------------------------------------------------------- run
def stepwatch_binary() -> Path:
    env = os.environ.get("STEPWATCH_BIN")
    candidates = [Path(env)] if env else []
    if REPO is not None:
        candidates += [REPO / "target/debug/stepwatch", REPO / "target/release/stepwatch"]
    on_path = shutil.which("stepwatch")
    candidates += [Path(on_path)] if on_path else []
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    die(
        "no stepwatch binary (it makes the fake GPUs): put it on PATH or set STEPWATCH_BIN"
        + (" (in a checkout: cargo build -p stepwatch)" if REPO is not None else "")
    )


def fake_nvml_lib(binary: Path) -> Path:
    """$STEPWATCH_FAKE_NVML_LIB (what `stepwatch preflight` passes), else the binary's."""
    given = os.environ.get("STEPWATCH_FAKE_NVML_LIB")
    if given and Path(given).is_file():
        return Path(given)
    return Path(fake_gpu(binary, Path("/nonexistent"), "lib-path"))


def fake_gpu(binary: Path, state: Path, *args: str) -> str:
    r = subprocess.run(
        [str(binary), "fake-gpu", "--dir", str(state), *args], capture_output=True, text=True
    )
    if r.returncode != 0:
        die(f"stepwatch fake-gpu {' '.join(args)}: {r.stderr.strip()}", code=1)
    return r.stdout.strip()


def cmd_run(a: argparse.Namespace) -> int:
    if not a.command:
        die("nothing to run: fake-cuda run [options] -- python train.py ...")
    python = a.python or default_python(a.command)
    libs = build(python)
    binary = stepwatch_binary()
    nvml_lib = fake_nvml_lib(binary)

    temp: Optional[tempfile.TemporaryDirectory[str]] = None
    state_env = os.environ.get(NVML_ENV)
    if a.state_dir:
        state = Path(a.state_dir)
    elif state_env and (Path(state_env) / "state.bin").exists():
        state = Path(state_env)
    else:
        temp = tempfile.TemporaryDirectory(prefix="fake-cuda-")
        state = Path(temp.name)
    if not (state / "state.bin").exists():
        state.mkdir(parents=True, exist_ok=True)
        fake_gpu(binary, state, "init", "--gpus", str(a.gpus), "--total-bytes", str(a.gpu_capacity))
        log(f"{a.gpus} fake GPU(s) of {a.gpu_capacity} bytes in {state}")
    elif not a.quiet:
        log(f"using the fake GPUs in {state}")
    if not a.quiet:
        for line in fake_gpu(binary, state, "show").splitlines():
            log(f"  {line}")

    libdir = Path(tempfile.mkdtemp(prefix="fake-cuda-lib-"))
    (libdir / "libnvidia-ml.so.1").symlink_to(nvml_lib)
    env = dict(os.environ)
    preload = [
        str(libs / n) for n in sorted(p.name for p in libs.iterdir() if p.suffix[1:].isdigit())
    ]
    env["LD_PRELOAD"] = ":".join(preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    env["LD_LIBRARY_PATH"] = ":".join(
        [str(libdir)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    )
    env[NVML_ENV] = str(state)
    env["STEPWATCH_FAKE_NVML_LIB"] = str(nvml_lib)
    env["STEPWATCH_FAKE_CUDA_CONTEXT_BYTES"] = str(a.context)
    if a.usage_log:
        Path(a.usage_log).mkdir(parents=True, exist_ok=True)
        env["STEPWATCH_FAKE_CUDA_USAGE_LOG"] = str(Path(a.usage_log).resolve())
    if a.kernel_time:
        env["STEPWATCH_FAKE_CUDA_KERNEL_NS"] = str(a.kernel_time)
    if a.nccl_bytes:
        env["STEPWATCH_FAKE_NCCL_COMM_BYTES"] = str(a.nccl_bytes)
    # ProcessGroupNCCL's heartbeat monitor watches for hung NCCL calls, which
    # the fake cannot have. (Suspected, not confirmed, of a rank's abort at
    # exit; see README.) A user's own setting wins.
    env.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
    if not a.quiet:
        print(LIMITS, file=sys.stderr, flush=True)

    try:
        proc = subprocess.Popen(a.command, env=env)
    except OSError as e:
        shutil.rmtree(libdir, ignore_errors=True)
        if temp is not None:
            temp.cleanup()
        die(f"cannot run {a.command[0]!r}: {e.strerror}")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    rc = proc.wait()
    shutil.rmtree(libdir, ignore_errors=True)
    if temp is not None:
        temp.cleanup()
    return rc if rc >= 0 else 128 - rc


def cmd_build(a: argparse.Namespace) -> int:
    out = build(a.python or default_python([]), force=a.force)
    print(out)
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    python = a.python or default_python([])
    torch_dir, version = torch_location(python)
    out = build_dir(version)
    print(
        f"python:  {python}\ntorch:   {version} ({torch_dir})\nlibs:    {out}"
        f" ({'stale or not built' if stale(out) else 'built'})"
    )
    for soname, names in sorted(imported(torch_dir).items()):
        print(f"  {soname}: torch imports {len(names)} functions")
    print(LIMITS)
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m stepwatch.fake_cuda",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a command on fake GPUs")
    r.add_argument("--gpus", type=int, default=1, help="fake GPUs to create (default 1)")
    r.add_argument(
        "--gpu-capacity",
        type=parse_size,
        default=parse_size("80GiB"),
        help="NVML total of each created GPU (default 80GiB; the driver reserves 512 MiB of it)",
    )
    r.add_argument(
        "--context",
        type=parse_size,
        default=parse_size("512MiB"),
        help="CUDA context charged per process and device (default 512MiB)",
    )
    r.add_argument(
        "--state-dir",
        help=f"fake-nvml state to use or create (default: ${NVML_ENV} if it "
        "holds one, else a temporary one)",
    )
    r.add_argument(
        "--usage-log",
        metavar="DIR",
        help="each process appends '<CLOCK_MONOTONIC ns>\\t<device>"
        "\\t<uuid>\\t<bytes>' to DIR/<pid>.tsv at every change of its device usage",
    )
    r.add_argument(
        "--kernel-time",
        type=parse_duration,
        default=0,
        help="time each kernel takes on its GPU, e.g. 50us (default 0: none); launches queue "
        "up to 1024 deep and synchronisations wait, so steps last as on a real GPU",
    )
    r.add_argument(
        "--nccl-bytes",
        type=parse_size,
        default=0,
        help="device bytes each NCCL communicator takes outside PyTorch's allocator (default 0)",
    )
    r.add_argument(
        "--python",
        help="the Python whose torch to build for (default: the command's, if it is python)",
    )
    r.add_argument("--quiet", action="store_true", help="do not print what is not supported")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    r.set_defaults(fn=cmd_run)
    b = sub.add_parser("build", help="build the libraries for a torch; prints their folder")
    b.add_argument("--python")
    b.add_argument("--force", action="store_true")
    b.set_defaults(fn=cmd_build)
    i = sub.add_parser("info", help="what is built for which torch")
    i.add_argument("--python")
    i.set_defaults(fn=cmd_info)
    a = p.parse_args(argv)
    if getattr(a, "command", None) and a.command[0] == "--":
        a.command = a.command[1:]
    if getattr(a, "gpus", 1) < 1 or getattr(a, "gpus", 1) > 16:
        die("--gpus must be 1..16")
    return int(a.fn(a))
