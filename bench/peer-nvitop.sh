#!/usr/bin/env bash
# Peer comparison: the stepwatch agent against nvitop-exporter (PyPI), both
# alive at once on the same fake NVML state, at the same per-GPU rate.
#
#   bench/peer-nvitop.sh [SECONDS=60]
#
# Environment (all optional):
#   RATES="4 100"  per-GPU sampling rates in Hz, one set of runs each. 4 Hz is
#                  nvitop-exporter's CLI minimum (--interval 0.25); faster
#                  rates lift that limit through the hook in peer-nvitop.py.
#   REPS=3         runs per rate; the table shows medians.
#   GPUS=8         fake GPUs.
#   BIN=path       stepwatch binary to use (skips the release build).
#   STEPWATCH_BENCH_VENV  venv for nvitop-exporter
#                  (default ~/.cache/stepwatch/bench-venv; created if missing).
#
# Per run: a fresh fake state with GPUS GPUs; `stepwatch agent --sample-hz HZ`
# and nvitop-exporter at interval 1/HZ both start on it; after both answer
# /metrics and a 5 s warm-up, CPU ns is read from /proc/PID/task/*/schedstat
# of each process at the start and end of a SECONDS window.
#
# GPU samples counted:
#   stepwatch: sum of stepwatch_gpu_samples_total (memory reads) from /metrics.
#   nvitop-exporter: completed PrometheusExporter.update_device() calls, counted
#     by the hook in bench/peer-nvitop.py. Its loop calls update_host() once
#     and then update_device() once per GPU each interval, so this equals
#     GPUs x loop iterations (both counts are printed).
# CPU per GPU sample = whole-process CPU ns in the window / samples in the window.
# RSS = VmRSS and VmHWM from /proc/PID/status at the end of the window.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS="${1:-60}"
RATES="${RATES:-4 100}"; REPS="${REPS:-3}"; GPUS="${GPUS:-8}"
VENV="${STEPWATCH_BENCH_VENV:-$HOME/.cache/stepwatch/bench-venv}"
say() { echo "[peer-nvitop $(date +%T)] $*" >&2; }

# --- the peer -------------------------------------------------------------
if ! "$VENV/bin/python" -c 'import nvitop_exporter' 2>/dev/null; then
  say "installing nvitop-exporter into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q nvitop-exporter nvitop
fi
PEER_VERSION="$("$VENV/bin/python" -c 'import nvitop, nvitop_exporter, pynvml, importlib.metadata as m; print("nvitop-exporter", nvitop_exporter.__version__, "/ nvitop", nvitop.__version__, "/ nvidia-ml-py", m.version("nvidia-ml-py"))')"
say "peer: $PEER_VERSION"

# --- our agent --------------------------------------------------------------
if [ -z "${BIN:-}" ]; then
  say "building stepwatch (release)"
  cargo build --release --locked -p stepwatch >/dev/null 2>&1 || cargo build --release --locked -p stepwatch
  BIN="${CARGO_TARGET_DIR:-target}/release/stepwatch"
fi
say "agent: $BIN ($("$BIN" --version 2>/dev/null || echo '?'), built $(date -r "$BIN" '+%F %T'))"

ROOT="$(mktemp -d)"
APID=; PPID_=; DIR=
stop() {
  for p in $APID $PPID_; do kill "$p" 2>/dev/null || true; done
  for p in $APID $PPID_; do wait "$p" 2>/dev/null || true; done
  APID=; PPID_=
}
cleanup() { stop; rm -rf "$ROOT"; }
trap cleanup EXIT
die() {
  say "ERROR: $*"
  for f in agent.log peer.log; do
    [ -n "$DIR" ] && [ -f "$DIR/$f" ] && { echo "--- $f" >&2; tail -n 30 "$DIR/$f" >&2; }
  done
  exit 1
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# Both processes' CPU ns (cpu_ns), then the agent's samples, the peer's samples,
# loops and update CPU ns (device, host), on one line.
counters() {
  echo "$(cpu_ns "$APID" agent) $(cpu_ns "$PPID_" peer)" \
    "$(metric_sum "$APORT" stepwatch_gpu_samples_total)" \
    "$(metric_sum "$PPORT" stepwatch_bench_peer_gpu_samples_total)" \
    "$(metric_sum "$PPORT" stepwatch_bench_peer_loops_total)" \
    "$(metric_sum "$PPORT" stepwatch_bench_peer_update_device_cpu_ns_total)" \
    "$(metric_sum "$PPORT" stepwatch_bench_peer_update_host_cpu_ns_total)"
}

cpu_ns() { # $1 pid, $2 agent|peer; prints "whole-process sampler-or-main-thread"
  local all=0 one=0 t v
  for t in /proc/"$1"/task/*; do
    v=$(cut -d' ' -f1 "$t/schedstat" 2>/dev/null || echo 0)
    all=$((all + v))
    if [ "$2" = agent ]; then
      if grep -q stepwatch-sampl "$t/comm" 2>/dev/null; then one=$((one + v)); fi
    elif [ "${t##*/}" = "$1" ]; then
      one=$((one + v))
    fi
  done
  echo "$all $one"
}
metric_sum() { # $1 port, $2 metric name prefix
  curl -sf "127.0.0.1:$1/metrics" | awk -v m="$2" 'index($1, m) == 1 && ($1 == m || substr($1, length(m) + 1, 1) == "{") {s += $NF} END {printf "%.0f", s}'
}
status_kb() { awk -v k="$2:" '$1 == k {print $2}' /proc/"$1"/status; }

RESULTS="$ROOT/results.tsv"
for HZ in $RATES; do
  INTERVAL=$(python3 -c "print(1/$HZ)")
  for REP in $(seq 1 "$REPS"); do
    DIR="$ROOT/hz$HZ-rep$REP"; mkdir -p "$DIR/lib"
    "$BIN" fake-gpu --dir "$DIR" init --gpus "$GPUS" >/dev/null
    ln -s "$("$BIN" fake-gpu --dir "$DIR" lib-path)" "$DIR/lib/libnvidia-ml.so.1"
    APORT=$(free_port); PPORT=$(free_port)

    STEPWATCH_FAKE_NVML_DIR="$DIR" "$BIN" agent --socket "$DIR/s.sock" \
      --http-listen "127.0.0.1:$APORT" --nvml-lib "$DIR/lib/libnvidia-ml.so.1" \
      --sample-hz "$HZ" 2>"$DIR/agent.log" &
    APID=$!
    # The CLI accepts --interval >= 0.25; below that the hook sets the interval.
    if python3 -c "import sys; sys.exit(0 if $INTERVAL >= 0.25 else 1)"; then
      PEER_ENV=(); CLI_INTERVAL=$INTERVAL
    else
      PEER_ENV=(STEPWATCH_BENCH_PEER_INTERVAL="$INTERVAL"); CLI_INTERVAL=0.25
    fi
    env STEPWATCH_FAKE_NVML_DIR="$DIR" LD_LIBRARY_PATH="$DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
      "${PEER_ENV[@]}" "$VENV/bin/python" bench/peer-nvitop.py --hostname bench \
      --bind-address 127.0.0.1 --port "$PPORT" --interval "$CLI_INTERVAL" 2>"$DIR/peer.log" &
    PPID_=$!

    say "$HZ Hz, run $REP/$REPS: agent pid $APID :$APORT, nvitop-exporter pid $PPID_ :$PPORT; waiting for /metrics"
    for _ in $(seq 1 300); do
      curl -sf -o /dev/null "127.0.0.1:$APORT/metrics" && curl -sf -o /dev/null "127.0.0.1:$PPORT/metrics" && break
      kill -0 "$APID" 2>/dev/null || die "agent exited early"
      kill -0 "$PPID_" 2>/dev/null || die "nvitop-exporter exited early"
      sleep 0.1
    done
    curl -sf -o /dev/null "127.0.0.1:$PPORT/metrics" || die "nvitop-exporter /metrics not up after 30 s"
    sleep 5
    if [ "$HZ$REP" = "${RATES%% *}1" ]; then
      MISSING=$(grep -o 'undefined symbol: [A-Za-z0-9_]*' "$DIR/peer.log" | awk '{print $3}' | sort -u | tr '\n' ' ' || true)
      say "peer runs; NVML symbols it calls that the fake lacks (read as N/A): ${MISSING:-none}"
    fi
    read -r ac0 as0 pc0 pm0 an0 pn0 pl0 pd0 ph0 < <(counters)
    say "$HZ Hz, run $REP/$REPS: measuring for ${SECS}s (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    sleep "$SECS"
    read -r ac1 as1 pc1 pm1 an1 pn1 pl1 pd1 ph1 < <(counters)
    say "$HZ Hz, run $REP/$REPS: done (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    kill -0 "$APID" 2>/dev/null || die "agent died during the window"
    kill -0 "$PPID_" 2>/dev/null || die "nvitop-exporter died during the window"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$HZ" "$REP" \
      $((ac1 - ac0)) $((as1 - as0)) $((an1 - an0)) $((pc1 - pc0)) $((pd1 - pd0)) $((pn1 - pn0)) $((pl1 - pl0)) \
      "$(status_kb "$APID" VmRSS)" "$(status_kb "$APID" VmHWM)" \
      "$(status_kb "$PPID_" VmRSS)" "$(status_kb "$PPID_" VmHWM)" "$SECS" $((ph1 - ph0)) >>"$RESULTS"
    stop
    tail -n 1 "$RESULTS" | awk -F'\t' -v g="$GPUS" '{
      printf "[peer-nvitop] %s Hz, run %s: stepwatch %.0f ns/sample (%d samples), nvitop-exporter %.0f ns/sample (%d samples, %d loops); RSS %.1f vs %.1f MiB\n",
        $1, $2, $3/$5, $5, $6/$8, $8, $9, $10/1024, $12/1024 }' >&2
  done
done

"$VENV/bin/python" - "$RESULTS" "$GPUS" "$SECS" "$REPS" "$PEER_VERSION" <<'PY'
import statistics as st, sys
path, gpus, secs, reps, peer = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
rows = [l.rstrip("\n").split("\t") for l in open(path)]
by = {}
for r in rows:
    hz = r[0]
    a_cpu, a_smp, a_n, p_cpu, p_dev, p_n, p_loops, a_rss, a_hwm, p_rss, p_hwm = map(int, r[2:13])
    p_host = int(r[14])
    by.setdefault(hz, []).append(dict(
        a=a_cpu / a_n, a_s=a_smp / a_n, p=p_cpu / p_n, p_d=p_dev / p_n, p_h=p_host / max(p_loops, 1),
        a_rate=a_n / secs / gpus, p_rate=p_n / secs / gpus, p_spl=p_n / max(p_loops, 1),
        a_core=100 * a_cpu / (secs * 1e9), p_core=100 * p_cpu / (secs * 1e9),
        a_rss=a_rss / 1024, a_hwm=a_hwm / 1024, p_rss=p_rss / 1024, p_hwm=p_hwm / 1024))
med = lambda xs, k: st.median(x[k] for x in xs)
print(f"\npeer: {peer}; {gpus} fake GPUs; {secs:.0f} s window; median of {reps} runs; both processes alive at once\n")
hdr = ("rate", "who", "CPU/GPU sample", "of which GPU reads", "achieved Hz/GPU", "% of a core", "VmRSS MiB", "VmHWM MiB")
fmt = "| {:>6} | {:<15} | {:>14} | {:>26} | {:>15} | {:>11} | {:>9} | {:>9} |"
print(fmt.format(*hdr))
print("|" + "|".join("-" * (len(h) + 2) for h in (f"{0:>6}", f"{0:<15}", f"{0:>14}", f"{0:>26}", f"{0:>15}", f"{0:>11}", f"{0:>9}", f"{0:>9}")) + "|")
for hz, xs in by.items():
    print(fmt.format(f"{hz} Hz", "stepwatch", f"{med(xs,'a'):.0f} ns", f"{med(xs,'a_s'):.0f} ns (sampler)",
                     f"{med(xs,'a_rate'):.2f}", f"{med(xs,'a_core'):.3f}", f"{med(xs,'a_rss'):.1f}", f"{med(xs,'a_hwm'):.1f}"))
    print(fmt.format("", "nvitop-exporter", f"{med(xs,'p'):.0f} ns", f"{med(xs,'p_d'):.0f} ns (update_device)",
                     f"{med(xs,'p_rate'):.2f}", f"{med(xs,'p_core'):.3f}", f"{med(xs,'p_rss'):.1f}", f"{med(xs,'p_hwm'):.1f}"))
    print(fmt.format("", "ratio peer/ours", f"{med(xs,'p')/med(xs,'a'):.0f}x", f"{med(xs,'p_d')/med(xs,'a_s'):.0f}x",
                     "", f"{med(xs,'p_core')/med(xs,'a_core'):.0f}x", f"{med(xs,'p_rss')/med(xs,'a_rss'):.1f}x", f"{med(xs,'p_hwm')/med(xs,'a_hwm'):.1f}x"))
print("\nper run (ns per GPU sample; MiB):")
for hz, xs in by.items():
    for i, x in enumerate(xs, 1):
        print(f"  {hz:>4} Hz run {i}: stepwatch {x['a']:.0f} (sampler {x['a_s']:.0f}), {x['a_rate']:.2f} Hz/GPU, RSS {x['a_rss']:.1f}/{x['a_hwm']:.1f}"
              f" | nvitop-exporter {x['p']:.0f} (update_device {x['p_d']:.0f}), {x['p_rate']:.2f} Hz/GPU, {x['p_spl']:.2f} samples/loop, update_host {x['p_h']/1e3:.0f} us/loop, RSS {x['p_rss']:.1f}/{x['p_hwm']:.1f}")
PY
