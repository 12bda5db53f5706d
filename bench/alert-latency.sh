#!/usr/bin/env bash
# Time from the marker that makes a step-2 OOM prediction to the alert in a
# real Alertmanager: through the agent's fast path (--alertmanager-url), and
# through a real Prometheus at kube-prometheus-stack's intervals.
#
#   bench/alert-latency.sh [RUNS=50] [PROM_RUNS=10]
#
# Runs the ignored benches of tests/alertmanager.rs: one agent on fake NVML
# and one `prometheus-alertmanager` (Debian package) on loopback; simulated
# thin-margin ranks (our simulator, not PyTorch), each predicted to run out
# of memory in step 2. Per rank: the newest marker's wall time in the batch
# that made the advisory (from the agent's --record), the advisory's time
# (the fast path's startsAt), and Alertmanager's updatedAt (when it took the
# POST; millisecond resolution).
#   alert_latency_bench: RUNS ranks one after another, fast path; prints
#     median, p99 and max of marker -> Alertmanager, advisory ->
#     Alertmanager, and advisory -> listed by the API (5 ms polls).
#   prometheus_path_latency_bench: no fast path; Prometheus (Debian package)
#     scrapes every 30 s and evaluates the shipped rules every 30 s; PROM_RUNS
#     ranks 6.3 s apart; prints median, min and max of marker -> Alertmanager.
#     Takes about PROM_RUNS × 6.3 s + 60 s.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${1:-50}"; PROM_RUNS="${2:-10}"
STEPWATCH_ALERT_BENCH_RUNS="$RUNS" cargo test --locked --test alertmanager alert_latency_bench \
  -- --ignored --nocapture --test-threads 1 2>&1 | grep -A3 'alert latency over'
STEPWATCH_PROM_BENCH_RUNS="$PROM_RUNS" cargo test --locked --test alertmanager prometheus_path_latency_bench \
  -- --ignored --nocapture --test-threads 1 2>&1 | grep 'prometheus path over'
