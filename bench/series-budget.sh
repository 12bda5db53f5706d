#!/usr/bin/env bash
# Series per node: 8 fake GPUs and one 8-rank job (the zero-sharded-8
# scenario, 12 steps), then counts the series on /metrics.
#
#   bench/series-budget.sh            # BIN=path skips the build
#   AGENT_ARGS="--rank-phase-series first-step" bench/series-budget.sh   # a cheaper export
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${BIN:-}" ]; then
  cargo build --locked -p stepwatch >/dev/null 2>&1 || cargo build --locked -p stepwatch
  BIN=target/debug/stepwatch
fi
. bench/fake-agent.sh
DIR="$(mktemp -d)"; PID=
trap 'kill "$PID" 2>/dev/null || true; rm -rf "$DIR"' EXIT
# shellcheck disable=SC2086 # AGENT_ARGS: flags, split on spaces
start_fake_agent "$DIR" 8 100 ${AGENT_ARGS:-}
wait_nvml_up || { echo "the agent did not sample the fake GPUs:" >&2; tail -20 "$DIR/agent.log" >&2; exit 1; }
for r in 0 1 2 3 4 5 6 7; do
  "$BIN" sim --scenario zero-sharded-8 --rank "$r" --steps 12 --speed 4 \
    --endpoint "unix://$DIR/s.sock" --fake-nvml-dir "$DIR" >/dev/null 2>&1 &
done
wait $(jobs -p | grep -v "^$PID$") 2>/dev/null || true
sleep 1
curl -s "127.0.0.1:$PORT/metrics" > "$DIR/metrics.txt"
echo "series on one node (8 GPUs, one 8-rank job): $(grep -vc '^#' "$DIR/metrics.txt")"
m="$DIR/metrics.txt"
per_rank=$(grep -v '^#' "$m" | grep -c 'rank="' || true)
per_gpu=$(grep -v '^#' "$m" | grep -v 'rank="' | grep -c 'gpu="' || true)
per_job=$(grep -v '^#' "$m" | grep -v 'rank="' | grep -v 'gpu="' | grep -c 'training_job="' || true)
echo "  with a rank label: $per_rank ($((per_rank / 8)) per rank); with a gpu label: $per_gpu ($((per_gpu / 8)) per GPU); per job: $per_job; the rest: $(( $(grep -vc '^#' "$m") - per_rank - per_gpu - per_job ))"
echo "  exposition: $(wc -c < "$m") bytes"
echo "largest families:"
grep -v '^#' "$DIR/metrics.txt" | sed 's/[{ ].*//' | sort | uniq -c | sort -rn | head -5
