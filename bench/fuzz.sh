#!/usr/bin/env bash
# Fuzz the ingest path (#11): hostile streams of hellos, marker batches,
# allocator-trace chunks, undecodable and bit-flipped bytes and GPU samples,
# through the wire decoder, the conversions, the tracker and the replay, in
# release builds, one process per core. Passes only with 0 panics.
#
#   bench/fuzz.sh                  # about 10.4 million inputs
#   STREAMS=100000 bench/fuzz.sh   # streams per process (about 8 inputs each)
set -euo pipefail
cd "$(dirname "$0")/.."
STREAMS="${STREAMS:-650000}"
JOBS="${JOBS:-$(nproc)}"
cargo test --locked --release -p stepwatch-agent --lib --no-run >/dev/null 2>&1 \
  || cargo test --locked --release -p stepwatch-agent --lib --no-run
start=$(date +%s)
pids=()
for i in $(seq "$JOBS"); do
  STEPWATCH_FUZZ_CASES="$STREAMS" cargo test --locked --release -q -p stepwatch-agent --lib \
    fuzz -- --nocapture 2>&1 | grep -E "^fuzz:|panicked|FAILED" > "target/fuzz-$i.log" &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
cat target/fuzz-*.log
total=$(grep -ho "[0-9]* inputs" target/fuzz-*.log | awk '{s+=$1} END {print s+0}')
echo "fuzz: $total inputs in $(( $(date +%s) - start )) s on $JOBS processes"
grep -q "panicked\|FAILED" target/fuzz-*.log && status=1
exit "$status"
