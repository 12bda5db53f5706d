#!/usr/bin/env bash
# The allocator model against allocator histories recorded on real GPUs.
#
# Extracts each snapshot pickle's history (bench/alloc_snapshots.py: the
# segments when the history began, then its events) and replays it through the
# model under each PyTorch version's rule for equal free blocks
# (stepwatch_core::allocator::FreeBlockOrder), printing a Markdown table: how
# many allocations land where the real allocator put them, and whether the
# reserved peak and end match. The public snapshots checked in BENCHMARKS.md
# are listed, with their source, in bench/alloc-snapshots.txt.
#
#   bench/alloc-snapshots.sh DIR        # every *.pickle / *.pkl in DIR
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 1 ] || [ ! -d "$1" ]; then
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
PY="${PYTHON:-python3}"
[ -x "$HOME/.cache/stepwatch/py-venv/bin/python" ] && PY="${PYTHON:-$HOME/.cache/stepwatch/py-venv/bin/python}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
shopt -s nullglob
PICKLES=("$1"/*.pickle "$1"/*.pkl)
if [ ${#PICKLES[@]} -eq 0 ]; then
  echo "no *.pickle or *.pkl in $1" >&2
  exit 2
fi
"$PY" bench/alloc_snapshots.py "$OUT" "${PICKLES[@]}" >&2
cargo build --release -q -p stepwatch-core --example snapshot_check
target/release/examples/snapshot_check "$OUT"/*.json
