#!/usr/bin/env bash
# Sampling jitter: tick lateness p50/p99/max at HZ with the other cores busy.
#
#   bench/sampler-jitter.sh [GPUS=8] [HZ=100] [SECONDS=60]
#
# Starts BUSY busy-loop processes (default: nproc - 1, i.e. "the other core
# busy" on a 2-core VM; unpinned, so the scheduler may put one on the
# sampler's core), then measures twice on fake NVML:
#   1. the sampler alone (example `sampler_bench` of stepwatch-gpu): p50/p99
#      from the sampler's lag histogram over the window, max from its trailing
#      max, and the sampler thread's CPU per GPU sample;
#   2. the whole agent (`stepwatch agent`): p50/p99 from the histogram
#      stepwatch_sampler_tick_lateness_seconds on /metrics if the agent exports
#      it, and the max of stepwatch_sampler_lag_seconds polled every 5 s.
# CARGO_TARGET_DIR is honoured; BIN=path skips building the agent.
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS="${1:-8}"; HZ="${2:-100}"; SECS="${3:-60}"
BUSY="${BUSY:-$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))}"
TARGET="${CARGO_TARGET_DIR:-target}"
HIST="${HIST:-stepwatch_sampler_tick_lateness_seconds}"

cargo build --release --locked -p stepwatch-gpu --example sampler_bench >/dev/null 2>&1 ||
  cargo build --release --locked -p stepwatch-gpu --example sampler_bench
. bench/fake-agent.sh
release_agent

BUSY_PIDS=(); PID=; DIR="$(mktemp -d)"
cleanup() {
  kill "${BUSY_PIDS[@]}" 2>/dev/null || true
  kill "$PID" 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT
for _ in $(seq "$BUSY"); do
  bash -c 'while :; do :; done' &
  BUSY_PIDS+=($!)
done
echo "busy loops: $BUSY (nproc $(nproc))"

echo "== sampler alone"
"$TARGET/release/examples/sampler_bench" "$GPUS" "$HZ" "$SECS"

echo "== whole agent"
start_fake_agent "$DIR" "$GPUS" "$HZ"
sleep 5
curl -s "127.0.0.1:$PORT/metrics" >"$DIR/m0"
max=0; left="$SECS"
while [ "$left" -gt 0 ]; do
  step=$(( left < 5 ? left : 5 )); sleep "$step"; left=$(( left - step ))
  v=$(curl -s "127.0.0.1:$PORT/metrics" | awk '/^stepwatch_sampler_lag_seconds[ {]/ {print $NF}')
  max=$(python3 -c "print(max($max, ${v:-0}))")
done
curl -s "127.0.0.1:$PORT/metrics" >"$DIR/m1"
python3 - "$DIR/m0" "$DIR/m1" "$HIST" "$max" <<'PY'
import re, sys
def hist(path, name):
    b = {}
    for line in open(path):
        m = re.match(name + r'_bucket\{.*le="([^"]+)".*\} (\S+)', line)
        if m:
            b[float(m.group(1))] = float(m.group(2))
    return b
m0, m1, name, mx = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
h0, h1 = hist(m0, name), hist(m1, name)
if not h1:
    print(f"{name} not exported by this agent: p50/p99 unavailable; max {mx*1e3:.3f} ms")
    sys.exit()
bounds = sorted(h1)
cum = [h1[b] - h0.get(b, 0) for b in bounds]
total = cum[-1]
def q(p):
    rank, lo_b, lo_c = p * total, 0.0, 0.0
    for b, c in zip(bounds, cum):
        if c >= rank:
            if b == float("inf"):
                return lo_b
            return lo_b + (b - lo_b) * ((rank - lo_c) / (c - lo_c) if c > lo_c else 1)
        lo_b, lo_c = b, c
    return lo_b
print(f"ticks {total:.0f}: p50 {q(0.5)*1e3:.3f} ms, p99 {q(0.99)*1e3:.3f} ms, max {mx*1e3:.3f} ms")
PY
