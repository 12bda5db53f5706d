#!/usr/bin/env bash
# Soak: the agent's limits driven at once (#11): memory (steps of 1024
# phases), streams that never say hello, a stream of short jobs, a flood of
# idle connections and allocator traces with thousands of segments (half
# never finished), beside a well-behaved rank. Loopback only, bounded in
# time. Prints a JSON summary: peak RSS, /healthz latency, refusals by
# reason, and whether the polite rank was served throughout.
#
#   bench/soak.sh                 # 10 minutes
#   bench/soak.sh --seconds 60    # shorter; other flags: bench/soak.py --help
#   BIN=path bench/soak.sh        # skip the build
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${BIN:-}" ]; then
  cargo build --locked --release -p stepwatch >/dev/null 2>&1 || cargo build --locked --release -p stepwatch
  BIN=target/release/stepwatch
fi
VENV="${STEPWATCH_PY_VENV:-$HOME/.cache/stepwatch/py-venv}"
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "no Python venv at $VENV: run python/run-tests.sh once (it makes it)" >&2; exit 2; }
DIR="$(mktemp -d)"
trap 'rm -rf "$DIR"' EXIT
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
PYTHONPATH="$PWD/python" "$PY" bench/soak.py --bin "$BIN" --dir "$DIR" --out target/soak.json "$@"
