#!/usr/bin/env bash
# A simulated cluster on one machine, measured (BENCHMARKS.md).
#
# N agents on fake NVML (G GPUs each, low sampling rate), every GPU running a
# simulated rank of an 8-rank zero-sharded-8 job that spans two nodes: node n
# runs ranks 0-3 of job n and ranks 4-7 of job n-1 (mod N). S Prometheus
# servers in agent mode each scrape a shard of the agents (hashmod on
# __address__) and remote-write to one central Prometheus
# (--web.enable-remote-write-receiver) that loads the shipped rules
# (deploy/prometheus/stepwatch-rules.yml) and evaluates them. Loopback only.
#
# Reports series per node and per rank, samples/s ingested centrally, the
# central server's RSS and the rule groups' evaluation time, as a table and
# as JSON (target/cluster/cluster-n<N>.json).
#
#   bench/cluster.sh [--nodes N] [--shards S] [--gpus G] [--scrape-interval 5s]
#                    [--measure SECONDS] [--timeout SECONDS] [--bin PATH]
#                    [--out FILE] [--keep]
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

NODES=10
SHARDS=2
GPUS=8
SCRAPE=5s
MEASURE=60
TIMEOUT=600
BIN=""
OUT=""
KEEP=0
SAMPLE_HZ=2
# Slower than the scenario's own timings (about 0.5 s a step): about 1 s a
# step, so that 2 Hz sampling sees every rank's step 1. At speed 4 on an idle
# machine ranks got no sample in step 1, and their jobs no job figures.
SIM_SPEED=0.5

usage() {
  sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
  cat <<EOF

Options:
  --nodes N            agents (default $NODES)
  --shards S           agent-mode Prometheus servers (default $SHARDS, at least 2)
  --gpus G             fake GPUs per agent, one rank each; a multiple of 8 (default $GPUS)
  --scrape-interval D  scrape interval of the shards and the central self-scrape (default $SCRAPE)
  --measure SECONDS    window over which samples/s are measured (default $MEASURE)
  --sample-hz HZ       agents' NVML sampling rate (default $SAMPLE_HZ)
  --sim-speed X        time scale of the simulated ranks (default $SIM_SPEED; 4 runs 8x faster than that)
  --timeout SECONDS    the whole run is killed after this (default $TIMEOUT)
  --bin PATH           stepwatch binary (default: cargo build, target/debug/stepwatch)
  --out FILE           JSON result (default target/cluster/cluster-n<N>.json)
  --keep               keep the temporary directory (logs, TSDBs)
Needs prometheus (Debian package prometheus, 2.42 tested), curl and python3,
all present after scripts/test.
EOF
}

while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) NODES="$2"; shift 2 ;;
    --shards) SHARDS="$2"; shift 2 ;;
    --gpus) GPUS="$2"; shift 2 ;;
    --scrape-interval) SCRAPE="$2"; shift 2 ;;
    --measure) MEASURE="$2"; shift 2 ;;
    --sample-hz) SAMPLE_HZ="$2"; shift 2 ;;
    --sim-speed) SIM_SPEED="$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    --bin) BIN="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ "$SHARDS" -ge 2 ] || { echo "--shards must be at least 2" >&2; exit 2; }
[ "$NODES" -ge 2 ] || { echo "--nodes must be at least 2 (jobs span two nodes)" >&2; exit 2; }
[ $((GPUS % 8)) -eq 0 ] && [ "$GPUS" -ge 8 ] || { echo "--gpus must be a multiple of 8" >&2; exit 2; }
for tool in prometheus curl python3; do
  command -v "$tool" >/dev/null || { echo "$tool is not on PATH (see --help)" >&2; exit 2; }
done
if [ -z "$BIN" ]; then
  cargo build --locked -p stepwatch >/dev/null 2>&1 || cargo build --locked -p stepwatch
  BIN="$REPO/target/debug/stepwatch"
fi
BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"
OUT="${OUT:-$REPO/target/cluster/cluster-n$NODES.json}"
mkdir -p "$(dirname "$OUT")"
RULES="$REPO/deploy/prometheus/stepwatch-rules.yml"

DIR="$(mktemp -d /tmp/stepwatch-cluster.XXXXXX)"
PIDS=()
SHARD_PIDS=()
cleanup() {
  trap - EXIT INT TERM
  # The simulated ranks are xargs's children (run_sim execs the binary).
  [ -n "${XARGS:-}" ] && pkill -TERM -P "$XARGS" 2>/dev/null || true
  # Shards first, so that they do not wait to flush to a stopped central server.
  local all=("${SHARD_PIDS[@]}" "${PIDS[@]}")
  for pid in "${all[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${all[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ "$KEEP" = 1 ]; then echo "kept $DIR" >&2; else rm -rf "$DIR"; fi
}
trap cleanup EXIT
trap 'echo "interrupted" >&2; exit 130' INT TERM
# Bounded in time: the watchdog ends the run (and the trap every child).
# Its sleep is ended with it, so no child outlives the script.
(
  trap 'kill "$sleeper" 2>/dev/null; exit 0' TERM
  sleep "$TIMEOUT" &
  sleeper=$!
  wait "$sleeper"
  echo "cluster.sh: timed out after ${TIMEOUT}s" >&2
  kill -TERM $$
) &
PIDS+=($!)

T_START=$(date +%s)
# json EXPR: evaluates a Python expression over the JSON document on stdin (d).
json() { python3 -c "import json, sys; d = json.load(sys.stdin); print($1)"; }
log() { echo "[+$(( $(date +%s) - T_START ))s] $*" >&2; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# wait_for WHAT SECONDS COMMAND...: polls COMMAND every 0.5 s.
wait_for() {
  local what="$1" secs="$2"; shift 2
  local deadline=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || { echo "timed out after ${secs}s waiting for $what" >&2; return 1; }
    sleep 0.5
  done
}

# --- agents ---------------------------------------------------------------
LIB="$("$BIN" fake-gpu --dir "$DIR/lib-probe" lib-path)"
log "starting $NODES agents ($GPUS fake GPUs each, ${SAMPLE_HZ} Hz)"
for n in $(seq 0 $((NODES - 1))); do
  d="$DIR/node-$n"
  mkdir -p "$d"
  "$BIN" fake-gpu --dir "$d" init --gpus "$GPUS" >/dev/null
  STEPWATCH_FAKE_NVML_DIR="$d" "$BIN" agent --socket "$d/s.sock" --http-listen 127.0.0.1:0 \
    --ready-file "$d/ready.json" --nvml-lib "$LIB" --node-name "node-$n" \
    --sample-hz "$SAMPLE_HZ" --process-interval 10s 2>"$d/agent.log" &
  PIDS+=($!)
  echo $! > "$d/pid"
done
AGENTS=()
for n in $(seq 0 $((NODES - 1))); do
  wait_for "agent node-$n's ready file" 60 test -s "$DIR/node-$n/ready.json"
  AGENTS+=("$(json 'd["http"]' < "$DIR/node-$n/ready.json")")
done

# --- central Prometheus ---------------------------------------------------
CENTRAL_PORT=$(free_port)
CENTRAL="127.0.0.1:$CENTRAL_PORT"
mkdir -p "$DIR/central"
{
  echo "global: {scrape_interval: $SCRAPE, evaluation_interval: 30s}"
  echo "rule_files: [\"$RULES\"]"
  echo "scrape_configs:"
  echo "  - job_name: prometheus-central"
  echo "    static_configs: [{targets: [\"$CENTRAL\"]}]"
} > "$DIR/central/prometheus.yml"
prometheus --config.file="$DIR/central/prometheus.yml" --storage.tsdb.path="$DIR/central/data" \
  --web.listen-address="$CENTRAL" --web.enable-remote-write-receiver 2>"$DIR/central/prometheus.log" &
CENTRAL_PID=$!
PIDS+=($CENTRAL_PID)

# --- shards: Prometheus in agent mode, hashmod over the agents' addresses --
SHARD_ADDRS=()
for s in $(seq 0 $((SHARDS - 1))); do
  port=$(free_port)
  SHARD_ADDRS+=("127.0.0.1:$port")
  d="$DIR/shard-$s"
  mkdir -p "$d"
  {
    echo "global: {scrape_interval: $SCRAPE, external_labels: {shard: \"$s\"}}"
    echo "scrape_configs:"
    echo "  - job_name: stepwatch"
    echo "    honor_labels: false"
    echo "    static_configs:"
    echo "      - targets: [$(printf '"%s",' "${AGENTS[@]}" | sed 's/,$//')]"
    echo "    relabel_configs:"
    echo "      - {source_labels: [__address__], modulus: $SHARDS, target_label: __tmp_hash, action: hashmod}"
    echo "      - {source_labels: [__tmp_hash], regex: \"$s\", action: keep}"
    echo "remote_write:"
    echo "  - url: http://$CENTRAL/api/v1/write"
    echo "    queue_config: {batch_send_deadline: 1s}"
  } > "$d/prometheus.yml"
  # A short flush deadline: at exit the central server may be gone already.
  prometheus --enable-feature=agent --config.file="$d/prometheus.yml" \
    --storage.agent.path="$d/data" --web.listen-address="127.0.0.1:$port" \
    --storage.remote.flush-deadline=2s 2>"$d/prometheus.log" &
  SHARD_PIDS+=($!)
done
wait_for "the central Prometheus" 60 curl -sf "http://$CENTRAL/-/ready"
for a in "${SHARD_ADDRS[@]}"; do wait_for "shard $a" 60 curl -sf "http://$a/-/ready"; done

query() { curl -sf --get "http://$CENTRAL/api/v1/query" --data-urlencode "query=$1" | json 'd["data"]["result"][0]["value"][1] if d["data"]["result"] else 0'; }

# --- simulated ranks: job j = ranks 0-3 on node j, 4-7 on node j+1 ----------
# A node's GPUs in quarters of 4: quarter q (GPUs 4q..4q+3) runs ranks 0-3
# of job (n, q/2) when q is even, ranks 4-7 of job (n-1, q/2) when odd. Every
# GPU holds one rank; every job has 8 ranks on two adjacent nodes.
log "running $((NODES * GPUS)) simulated ranks"
SIMS="$DIR/sims.txt"
: > "$SIMS"
for n in $(seq 0 $((NODES - 1))); do
  for q in $(seq 0 $((GPUS / 4 - 1))); do
    half=$((q % 2))                       # 0: ranks 0-3, 1: ranks 4-7
    pair=$((q / 2))                       # which job pair this quarter belongs to
    home=$(( (n - half + NODES) % NODES ))  # node where the job's ranks 0-3 run
    job="cluster-job-$home-$pair"
    for k in 0 1 2 3; do
      echo "$n $((4 * q + k)) $job $((4 * half + k))" >> "$SIMS"
    done
  done
done
run_sim() {
  local n="$1" gpu="$2" job="$3" rank="$4" d="$DIR/node-$1"
  exec "$BIN" sim --scenario zero-sharded-8 --job "$job" --rank "$rank" --gpu "$gpu" --steps 6 --speed "$SIM_SPEED" \
    --endpoint "unix://$d/s.sock" --fake-nvml-dir "$d" >/dev/null 2>>"$DIR/sims.log"
}
export -f run_sim
export BIN DIR SIM_SPEED
xargs -P 32 -L 1 bash -c 'run_sim "$@"' _ < "$SIMS" &
XARGS=$!
PIDS+=($XARGS)
wait $XARGS || { echo "some simulated ranks failed: $(tail -5 "$DIR/sims.log")" >&2; exit 1; }
log "ranks done"

RANKS=$((NODES * GPUS))
ranks_central() { [ "$(query 'count(stepwatch_rank_info)')" = "$RANKS" ]; }
wait_for "all $RANKS ranks in the central Prometheus" 120 ranks_central
log "all ranks visible centrally"

# --- measurement ----------------------------------------------------------
# samples appended to the central head (remote write + rules + self-scrape)
central_appended() {
  curl -sf "http://$CENTRAL/metrics" | awk '/^prometheus_tsdb_head_samples_appended_total/ {s += $2} END {printf "%.0f\n", s}'
}
shards_sent() {
  local total=0 v
  for a in "${SHARD_ADDRS[@]}"; do
    v=$(curl -sf "http://$a/metrics" | awk '/^prometheus_remote_storage_samples_total/ {s += $2} END {printf "%.0f\n", s}')
    total=$((total + v))
  done
  echo "$total"
}
# One recording evaluation after every rank arrived, then the window.
eval_after() { [ "$(query 'timestamp(stepwatch_job:ranks_reporting:count)' | cut -d. -f1)" -gt "$1" ]; }
NOW=$(date +%s)
wait_for "a recording-rule evaluation" 90 eval_after "$NOW"
log "measuring for ${MEASURE}s"
A0=$(central_appended); TA0=$(date +%s.%N); S0=$(shards_sent); TS0=$(date +%s.%N)
sleep "$MEASURE"
A1=$(central_appended); TA1=$(date +%s.%N); S1=$(shards_sent); TS1=$(date +%s.%N)

RSS_KB=$(awk '/^VmRSS/ {print $2}' "/proc/$CENTRAL_PID/status")
SHARD_RSS=$(for a in "${SHARD_ADDRS[@]}"; do curl -sf "http://$a/metrics" | awk '/^process_resident_memory_bytes/ {print $2}'; done | paste -sd, -)
AGENT_RSS=$(for n in $(seq 0 $((NODES - 1))); do awk '/^VmRSS/ {print $2}' "/proc/$(cat "$DIR/node-$n/pid")/status"; done | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
HEAD_SERIES=$(query 'prometheus_tsdb_head_series{job="prometheus-central"}')
SW_SERIES=$(query 'count({__name__=~"stepwatch_.+", __name__!~".*:.*"})')
RANK_SERIES=$(query 'count({__name__=~"stepwatch_.+", __name__!~".*:.*", rank!=""})')
GPU_SERIES=$(query 'count({__name__=~"stepwatch_.+", __name__!~".*:.*", rank="", gpu!=""})')
RECORDED=$(query 'count({__name__=~"stepwatch_job.*:.+"})')
UP_SERIES=$(query 'count({job="stepwatch", __name__!~"stepwatch_.+"})')
NODE_MAX=$(query 'max(count by (node) ({__name__=~"stepwatch_.+", __name__!~".*:.*"}))')
NODE_MIN=$(query 'min(count by (node) ({__name__=~"stepwatch_.+", __name__!~".*:.*"}))')
PHASE_PEAK=$(query 'count(stepwatch_rank_phase_peak_bytes)')
SHARD_TARGETS=$(for a in "${SHARD_ADDRS[@]}"; do curl -sf "http://$a/api/v1/targets?state=active" | json 'sum(t["labels"]["job"] == "stepwatch" for t in d["data"]["activeTargets"])'; done | paste -sd, -)
RULES_JSON=$(curl -sf "http://$CENTRAL/api/v1/rules" | json 'json.dumps([{"name": g["name"], "interval": g["interval"], "evaluation_seconds": g["evaluationTime"], "rules": len(g["rules"])} for g in d["data"]["groups"]])')
# Each job's step-1 peak spread across its ranks ((max - min) / median):
# every rank of a job runs the same scenario, so any spread is the
# measurement's, not the ranks'.
STEP1_SPREAD=$(curl -sf --get "http://$CENTRAL/api/v1/query" --data-urlencode \
  'query=stepwatch_job:first_step_peak_divergence_ratio' \
  | json 'json.dumps(sorted(round(float(r["value"][1]), 4) for r in d["data"]["result"]))')
ALERTS=$(curl -sf "http://$CENTRAL/api/v1/alerts" | json 'json.dumps({n: [a["labels"]["alertname"] for a in d["data"]["alerts"]].count(n) for n in {a["labels"]["alertname"] for a in d["data"]["alerts"]}})')
# Over the window (the central server scrapes itself): rule evaluations'
# median and worst, and CPU seconds per second of each Prometheus.
W="$(python3 -c "print(int($TA1 - $TA0))")s"
RULE_P50=$(curl -sf --get "http://$CENTRAL/api/v1/query" --data-urlencode \
  "query=quantile_over_time(0.5, prometheus_rule_group_last_duration_seconds{job=\"prometheus-central\"}[$W])" \
  | json 'json.dumps({r["metric"]["rule_group"].split(";")[-1]: float(r["value"][1]) for r in d["data"]["result"]})')
RULE_MAX=$(curl -sf --get "http://$CENTRAL/api/v1/query" --data-urlencode \
  "query=max_over_time(prometheus_rule_group_last_duration_seconds{job=\"prometheus-central\"}[$W])" \
  | json 'json.dumps({r["metric"]["rule_group"].split(";")[-1]: float(r["value"][1]) for r in d["data"]["result"]})')
CENTRAL_CPU=$(query "rate(process_cpu_seconds_total{job=\"prometheus-central\"}[$W])")
FAMILIES=$(curl -sf --get "http://$CENTRAL/api/v1/query" --data-urlencode \
  'query=topk(8, count by (__name__) ({__name__=~"stepwatch_.+", __name__!~".*:.*"}))' \
  | json 'json.dumps({r["metric"]["__name__"]: int(r["value"][1]) for r in d["data"]["result"]})')
CPU=$(nproc)
LOAD=$(cut -d' ' -f1-3 /proc/loadavg)

python3 - "$OUT" <<EOF
import json, sys
appended = ($A1 - $A0) / ($TA1 - $TA0)
sent = ($S1 - $S0) / ($TS1 - $TS0)
r = {
  "nodes": $NODES, "shards": $SHARDS, "gpus_per_node": $GPUS, "ranks": $RANKS,
  "jobs": $NODES * $GPUS // 8, "scrape_interval": "$SCRAPE", "sample_hz": $SAMPLE_HZ,
  "shard_targets": [int(x) for x in "$SHARD_TARGETS".split(",")],
  "central_head_series": int(float("$HEAD_SERIES")),
  "stepwatch_series": int("$SW_SERIES"),
  "rank_series": int("$RANK_SERIES"),
  "gpu_series": int("$GPU_SERIES"),
  "phase_peak_series": int("$PHASE_PEAK"),
  "recorded_series": int("$RECORDED"),
  "scrape_meta_series": int("$UP_SERIES"),
  "series_per_node": $SW_SERIES / $NODES,
  "series_per_node_min_max": [int("$NODE_MIN"), int("$NODE_MAX")],
  "series_per_rank": $RANK_SERIES / $RANKS,
  "series_per_gpu": $GPU_SERIES / ($NODES * $GPUS),
  "samples_per_s_central": round(appended, 1),
  "samples_per_s_remote_written": round(sent, 1),
  "measure_seconds": round($TA1 - $TA0, 1),
  "central_rss_bytes": $RSS_KB * 1024,
  "shard_rss_bytes": [int(float(x)) for x in "$SHARD_RSS".split(",")],
  "agent_rss_bytes_median": $AGENT_RSS * 1024,
  "rule_groups": json.loads('''$RULES_JSON'''),
  "rule_group_seconds_p50_over_window": json.loads('''$RULE_P50'''),
  "rule_group_seconds_max_over_window": json.loads('''$RULE_MAX'''),
  "central_cpu_cores": round(float("$CENTRAL_CPU"), 3),
  "largest_families": json.loads('''$FAMILIES'''),
  "alerts": json.loads('''$ALERTS'''),
  "first_step_peak_spreads": json.loads('''$STEP1_SPREAD'''),
  "machine": {"cpus": $CPU, "loadavg_at_end": "$LOAD"},
}
json.dump(r, open(sys.argv[1], "w"), indent=2)
g = {x["name"]: x for x in r["rule_groups"]}
mib = lambda b: f"{b / 2**20:.0f} MiB"
rows = [
  ("nodes / shards / ranks / jobs", f"{r['nodes']} / {r['shards']} ({'+'.join(map(str, r['shard_targets']))} targets) / {r['ranks']} / {r['jobs']}"),
  ("central head series", r["central_head_series"]),
  ("stepwatch series (scraped)", r["stepwatch_series"]),
  ("  per node (min-max)", f"{r['series_per_node']:.0f} ({r['series_per_node_min_max'][0]}-{r['series_per_node_min_max'][1]})"),
  ("  per rank", f"{r['series_per_rank']:.1f} (phase peaks {r['phase_peak_series'] / r['ranks']:.1f})"),
  ("  per GPU", f"{r['series_per_gpu']:.1f}"),
  ("recorded (rule) series", r["recorded_series"]),
  ("samples/s appended centrally", r["samples_per_s_central"]),
  ("samples/s remote-written", r["samples_per_s_remote_written"]),
  ("central RSS", mib(r["central_rss_bytes"])),
  ("shard RSS", ", ".join(mib(x) for x in r["shard_rss_bytes"])),
  ("agent RSS (median)", mib(r["agent_rss_bytes_median"])),
  ("central CPU (cores)", r["central_cpu_cores"]),
] + [(f"rule group {n} ({x['rules']} rules)",
      f"last {x['evaluation_seconds'] * 1000:.1f} ms, window median "
      f"{r['rule_group_seconds_p50_over_window'].get(n, 0) * 1000:.1f} ms, max "
      f"{r['rule_group_seconds_max_over_window'].get(n, 0) * 1000:.1f} ms") for n, x in g.items()]
w = max(len(k) for k, _ in rows)
for k, v in rows:
    print(f"{k:<{w}}  {v}")
print(f"largest families: {r['largest_families']}")
print(f"alerts: {r['alerts']}")
spreads = r["first_step_peak_spreads"]
print(f"step-1 peak spread across each job's ranks: max {max(spreads, default=0):.1%}, "
      f"above 10% (StepwatchFirstStepDivergence) in {sum(x > 0.1 for x in spreads)} of {len(spreads)} jobs")
print(f"JSON: {sys.argv[1]}")
EOF
log "done"
