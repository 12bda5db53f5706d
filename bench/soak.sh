#!/usr/bin/env bash
# Soak: the agent's limits driven at once by hostile and unlucky clients
# (memory, silent streams, one-step ranks that disconnect, a connection
# flood, silent unfinished traces, idle gRPC channels, one process taking
# every stream, held HTTP connections, concurrent large reports, clock
# jumps), beside a well-behaved rank, under the chart's 192 MiB memory limit
# (a memory cgroup when this user can make one; else RSS is measured against
# it). The attacks run as other pods would: a process each, as another uid
# when run as root, from other loopback addresses over HTTP. Loopback only,
# bounded in time. Prints a JSON summary: peak RSS (and the cgroup's peak),
# probe success rate, how long the polite rank's steps waited to be counted,
# refusals by reason.
#
#   bench/soak.sh                 # 10 minutes
#   bench/soak.sh --seconds 120   # shorter; other flags: bench/soak.py --help
#   BIN=path bench/soak.sh        # skip the build
#   KEEP_DIR=dir bench/soak.sh    # keep the agent's log there
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
trap '[ -n "${KEEP_DIR:-}" ] && cp "$DIR/agent.log" "$KEEP_DIR/"; rm -rf "$DIR"' EXIT
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
PYTHONPATH="$PWD/python" "$PY" bench/soak.py --bin "$BIN" --dir "$DIR" --out target/soak.json "$@"
