#!/usr/bin/env bash
# Lint and test the stepwatch Python client.
#
# Creates (or reuses) a virtualenv at $STEPWATCH_PY_VENV (default
# ~/.cache/stepwatch/py-venv, so CI re-runs on one machine reuse it), installs
# ./python[test] with real PyTorch (CPU path), Lightning and transformers, then
# runs ruff, mypy (strict) and pytest. A lint or type error stops it; otherwise
# pytest's exit code is the script's exit code.
#
# The agent integration tests need the agent binary ($STEPWATCH_BIN or
# target/debug/stepwatch: `cargo build -p stepwatch`); they fail without it
# unless STEPWATCH_SKIP_AGENT_TESTS=1.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
VENV="${STEPWATCH_PY_VENV:-$HOME/.cache/stepwatch/py-venv}"
PYTHON="${PYTHON:-python3}"
# Plain `torch` from the package index: on Linux x86_64 it brings its CUDA
# libraries (~5.4 GB, ~1 min on a fast link); no CPU-only build is published
# there. Override with e.g. STEPWATCH_TORCH_SPEC="torch==2.5.1".
TORCH_SPEC="${STEPWATCH_TORCH_SPEC:-torch}"
EXTRAS_SPEC="${STEPWATCH_EXTRAS_SPEC:-lightning transformers accelerate}"

step() { printf '==> %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  step "creating virtualenv $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
else
  step "reusing virtualenv $VENV"
fi
PY="$VENV/bin/python"

t0=$(date +%s)
step "installing torch ($TORCH_SPEC)"
if ! "$PY" -c 'import torch' 2>/dev/null; then
  "$PY" -m pip install --quiet --disable-pip-version-check $TORCH_SPEC
fi
step "installing lightning, transformers ($EXTRAS_SPEC)"
if ! "$PY" -c 'import lightning, transformers, accelerate' 2>/dev/null; then
  "$PY" -m pip install --quiet --disable-pip-version-check $EXTRAS_SPEC \
    || step "WARNING: could not install $EXTRAS_SPEC; their tests will be skipped"
fi
step "installing ./python[test]"
"$PY" -m pip install --quiet --disable-pip-version-check "$HERE[test]"
step "installs took $(( $(date +%s) - t0 ))s; venv is $(du -sh "$VENV" 2>/dev/null | cut -f1)"
"$PY" -c 'import torch, grpc, google.protobuf as p; print("torch", torch.__version__, "grpcio", grpc.__version__, "protobuf", p.__version__)'

step "ruff check python"
cd "$REPO"
"$VENV/bin/ruff" check python
step "ruff format --check python"
"$VENV/bin/ruff" format --check python
step "mypy --strict python/stepwatch (settings in python/pyproject.toml)"
(cd "$HERE" && "$VENV/bin/mypy")

if [ -z "${STEPWATCH_BIN:-}" ] && [ ! -x "$REPO/target/debug/stepwatch" ] \
   && [ "${STEPWATCH_SKIP_AGENT_TESTS:-}" != "1" ]; then
  step "NOTE: no agent binary at target/debug/stepwatch; the agent integration tests will fail"
fi

step "pytest"
cd "$HERE"
# pytest puts tests/ (not python/) on sys.path, so `import stepwatch` is the
# installed copy: this tests what `pip install ./python` installs.
set +e
"$PY" -m pytest -p no:cacheprovider "$@"
rc=$?
set -e
step "pytest exit code $rc"
exit $rc
