#!/usr/bin/env bash
# Time from the marker that makes a step-2 OOM prediction to the alert in a
# real Alertmanager, through the agent's fast path (--alertmanager-url).
#
#   bench/alert-latency.sh [RUNS=50]
#
# Runs tests/alertmanager.rs's ignored `alert_latency_bench`: one agent on
# fake NVML posting to one `prometheus-alertmanager` (Debian package) on
# loopback; RUNS simulated thin-margin ranks (our simulator, not PyTorch),
# one after another, each predicted to run out of memory in step 2. Per run:
# the newest marker's wall time in the batch that made the advisory (from
# the agent's --record), the advisory's time (the alert's startsAt), and
# Alertmanager's updatedAt (when it took the POST; millisecond resolution).
# Prints median, p99 and max of marker -> Alertmanager, advisory ->
# Alertmanager, and advisory -> listed by the API (5 ms polls).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${1:-50}"
STEPWATCH_ALERT_BENCH_RUNS="$RUNS" cargo test --locked --test alertmanager alert_latency_bench \
  -- --ignored --nocapture --test-threads 1 2>&1 | grep -A3 'alert latency over'
