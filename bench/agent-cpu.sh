#!/usr/bin/env bash
# Measures the agent's own CPU per GPU sample and its memory, on fake NVML.
#
#   bench/agent-cpu.sh [GPUS=8] [HZ=100] [SECONDS=60]
#
# Builds the release binary, creates GPUS fake GPUs, runs `stepwatch agent`
# at HZ for SECONDS after a 5 s warm-up, and reads CPU time from
# /proc/PID/task/*/schedstat (ns resolution) and samples from /metrics.
# Prints CPU ns per sample (whole process and sampler thread alone), the
# share of one core, sampler lag, and RSS (VmRSS, VmHWM).
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS="${1:-8}"; HZ="${2:-100}"; SECS="${3:-60}"
. bench/fake-agent.sh

# CARGO_TARGET_DIR is honoured; BIN=path skips the build (to compare two binaries).
release_agent
DIR="$(mktemp -d)"
PID=
cleanup() {
  if [ -n "$PID" ] && ! kill -0 "$PID" 2>/dev/null; then
    echo "agent exited early; its log:" >&2; tail -n 20 "$DIR/agent.log" >&2
  fi
  kill "$PID" 2>/dev/null || true; rm -rf "$DIR"
}
trap cleanup EXIT
start_fake_agent "$DIR" "$GPUS" "$HZ"

cpu_ns() { # whole process, and the sampler thread
  local all=0 sampler=0 t v
  for t in /proc/"$PID"/task/*; do
    v=$(cut -d' ' -f1 "$t/schedstat")
    all=$((all + v))
    if grep -q stepwatch-sampl "$t/comm"; then sampler=$((sampler + v)); fi
  done
  echo "$all $sampler"
}
samples() {
  curl -s "127.0.0.1:$PORT/metrics" | awk '/^stepwatch_gpu_samples_total/ {s += $NF} END {printf "%d", s}'
}

sleep 5
read -r c0 s0 < <(cpu_ns); n0=$(samples)
sleep "$SECS"
read -r c1 s1 < <(cpu_ns); n1=$(samples)
lag=$(curl -s "127.0.0.1:$PORT/metrics" | awk '/^stepwatch_sampler_lag_seconds/ {print $NF}')
late=$(curl -s "127.0.0.1:$PORT/metrics" | awk '/^stepwatch_sampler_late_ticks_total/ {print $NF}')
rss=$(awk '/VmRSS/ {print $2}' /proc/"$PID"/status); hwm=$(awk '/VmHWM/ {print $2}' /proc/"$PID"/status)
n=$((n1 - n0))
python3 - "$n" "$((c1 - c0))" "$((s1 - s0))" "$SECS" "$GPUS" "$HZ" "$lag" "$late" "$rss" "$hwm" <<'PY'
import sys
n, cpu, sampler, secs, gpus, hz, lag, late, rss, hwm = sys.argv[1:]
n, cpu, sampler, secs = int(n), int(cpu), int(sampler), float(secs)
print(f"gpus={gpus} hz={hz} window={secs:.0f}s samples={n} (expected {int(gpus)*float(hz)*secs:.0f})")
print(f"agent CPU per GPU sample:   {cpu/n:8.0f} ns  (whole process)")
print(f"sampler CPU per GPU sample: {sampler/n:8.0f} ns  (sampler thread only)")
print(f"agent CPU share of one core: {100*cpu/(secs*1e9):.3f} %")
print(f"sampler lag (15 s max): {float(lag)*1e3:.3f} ms, late ticks: {late}")
print(f"RSS: {int(rss)/1024:.1f} MiB (peak {int(hwm)/1024:.1f} MiB)")
PY
