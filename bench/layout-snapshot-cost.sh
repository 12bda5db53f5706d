#!/usr/bin/env bash
# The Python client's segment-snapshot cost on the training thread, on
# unmodified PyTorch on fake CUDA (bench/layout_snapshot_cost.py has the
# details; --help lists its flags):
#
#   bench/layout-snapshot-cost.sh               # GPT-2 small, 200 timings each
#   bench/layout-snapshot-cost.sh --repeats 50
#
# PYTHON: the interpreter with torch (default: the test venv
# ~/.cache/stepwatch/py-venv, else python3). STEPWATCH_BIN: the stepwatch
# binary fake CUDA takes its fake GPUs from (default target/debug/stepwatch,
# built when missing). About half a minute once built.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x "$HOME/.cache/stepwatch/py-venv/bin/python" ] && PYTHON="$HOME/.cache/stepwatch/py-venv/bin/python"
fi
if [ -z "${STEPWATCH_BIN:-}" ]; then
  export STEPWATCH_BIN="$REPO/target/debug/stepwatch"
  [ -x "$STEPWATCH_BIN" ] || (cd "$REPO" && cargo build -p stepwatch)
fi
export PYTHONPATH="$REPO/python${PYTHONPATH:+:$PYTHONPATH}"
exec "$REPO/crates/fake-cuda/fake-cuda" run --python "$PYTHON" --gpu-capacity 48GiB --quiet -- \
  "$PYTHON" "$REPO/bench/layout_snapshot_cost.py" "$@"
