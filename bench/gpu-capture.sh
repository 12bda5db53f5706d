#!/usr/bin/env bash
# Captures real-GPU fixtures for the step-2 predictor, in one call on a GPU
# machine (see python/README.md, "Capturing real-GPU fixtures"):
#
#   bench/gpu-capture.sh            # on the GPU machine, from the repo root
#   bench/gpu-capture.sh --fake     # here: fake NVML, CPU training, tiny sizes
#                                   # (or GPU_CAPTURE_FAKE=1)
#
# For each run (GPU_CAPTURE_RUNS, default "adamw sgd": an optimizer name of
# python/tools/gpu_train.py), it starts `stepwatch agent --record
# $OUT/<run>.jsonl`, waits for /readyz, trains python/tools/gpu_train.py
# against it (bf16 autocast GPT, ~355M parameters, 12 steps), saves the rank's
# report to $OUT/<run>-report.json and /metrics to $OUT/metrics.txt, and stops
# the agent with SIGTERM. Then `stepwatch replay-record` of each record goes to
# $OUT/summary.txt. Everything it prints is also in $OUT/capture.log, agents'
# logs included. At most 8 files land in $OUT (the device tool's limit): with
# the default two runs, 7. A record over 15 MiB is gzipped (16 MiB per file
# comes back).
#
# The agent is $STEPWATCH_BIN, else .whl/stepwatch (the stripped copy
# bench/gpu-wheels.sh makes), else target/release/stepwatch (fake mode: the
# other way round, since the fake NVML library is found next to that binary).
# Wheels in .whl/*.whl (bench/gpu-wheels.sh: grpcio, protobuf) are installed
# into a private --target folder put first on PYTHONPATH; python/ goes after
# it, so `import stepwatch` is this checkout's client.
#
# Knobs: OUT (default: a new temp folder), PYTHON (default python3; in fake
# mode the client's test venv when present), GPU_CAPTURE_RUNS,
# GPU_TRAIN_ARGS (extra flags for gpu_train.py, appended: later flags win),
# GPU_CAPTURE_TRAIN_TIMEOUT (s per training run, default 150),
# GPU_CAPTURE_ALLOW_NO_RECORD=1 (run even if the agent lacks --record).
#
# Exit status: 0 when every run trained and its report was saved; 1 otherwise
# (what is in $OUT still comes back).
set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 1

FAKE="${GPU_CAPTURE_FAKE:-0}"
for arg in "$@"; do
  case "$arg" in
    --fake) FAKE=1 ;;
    -h | --help)
      sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "gpu-capture: unknown argument '$arg' (try --help)" >&2
      exit 2
      ;;
  esac
done
[ "$FAKE" = 1 ] || FAKE=0

if [ -z "${OUT:-}" ]; then
  OUT="$(mktemp -d /tmp/gpu-capture-out.XXXXXX)"
fi
export OUT
mkdir -p "$OUT" || exit 1
# Ours, appended to below: start them afresh when OUT is reused.
rm -f "$OUT/capture.log" "$OUT/metrics.txt" "$OUT/summary.txt"
# Short: Unix socket paths must stay under ~100 bytes.
WORK="$(mktemp -d /tmp/swcap.XXXXXX)" || exit 1
T0=$SECONDS
AGENT_PID=""
FAILED=0

# Everything from here on also goes to $OUT/capture.log.
exec > >(tee -a "$OUT/capture.log") 2>&1

log() { printf '[%s +%3ds] %s\n' "$(date -u +%H:%M:%S)" $((SECONDS - T0)) "$*"; }
warn() { log "WARNING: $*"; }
die() {
  log "FATAL: $*"
  exit 1
}

stop_agent() {
  local pid="$AGENT_PID" i
  [ -n "$pid" ] || return 0
  AGENT_PID=""
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    for i in $(seq 1 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      warn "agent $pid ignored SIGTERM for 10 s; killing it"
      kill -KILL "$pid" 2>/dev/null
    fi
  fi
  wait "$pid" 2>/dev/null
  log "agent $pid stopped (exit status $?)"
}

cleanup() {
  local rc=$?
  stop_agent
  rm -rf "$WORK"
  log "done in $((SECONDS - T0)) s, exit status $rc; files in $OUT:"
  ls -l "$OUT"
  # Let tee write the last lines before the shell goes.
  exec >&- 2>&-
  wait 2>/dev/null
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM

log "gpu-capture: mode $([ "$FAKE" = 1 ] && echo fake || echo real), repo $REPO, OUT $OUT"
log "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --short 2>/dev/null | wc -l) changed file(s)"

# ---------------------------------------------------------------- python ----
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if [ "$FAKE" = 1 ] && [ -x "$HOME/.cache/stepwatch/py-venv/bin/python" ]; then
    PYTHON="$HOME/.cache/stepwatch/py-venv/bin/python"
  fi
fi
command -v "$PYTHON" >/dev/null || die "no python at '$PYTHON' (set PYTHON=...)"
log "python: $(command -v "$PYTHON") ($("$PYTHON" -c 'import sys; print(sys.version.split()[0])'))"

SITE="$WORK/site"
shopt -s nullglob
WHEELS=(.whl/*.whl)
shopt -u nullglob
if [ ${#WHEELS[@]} -gt 0 ]; then
  log "installing ${#WHEELS[@]} carried wheel(s) into $SITE: ${WHEELS[*]##*/}"
  if PIP_ROOT_USER_ACTION=ignore timeout -k 5 120 "$PYTHON" -m pip install -q \
    --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${WHEELS[@]}"; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    warn "the wheels did not install (another Python version?); using the installed grpcio/protobuf"
  fi
else
  log "no wheels in .whl/: using the installed grpcio/protobuf"
fi
# The client is pure Python: importable from python/ as it is.
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$REPO/python"
export PYTHONUNBUFFERED=1
log "PYTHONPATH=$PYTHONPATH"

if command -v nvidia-smi >/dev/null; then
  log "nvidia-smi:"
  timeout -k 5 30 nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.used,driver_version \
    --format=csv
  timeout -k 5 30 nvidia-smi
else
  log "no nvidia-smi on PATH"
fi

log "versions:"
timeout -k 5 120 "$PYTHON" - <<'PY'
import importlib.metadata as md
import sys

print("python", sys.version.split()[0], sys.executable)
for dist in ("torch", "grpcio", "protobuf", "typing_extensions", "numpy"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist} (not installed)")
try:
    import google.protobuf as pb
    import grpc

    print("imported grpc", grpc.__version__, grpc.__file__)
    print("imported protobuf", pb.__version__, pb.__file__)
except Exception as e:
    print("grpc/protobuf import failed:", repr(e))
try:
    import torch

    print("torch.cuda.is_available()", torch.cuda.is_available(), "cuda", torch.version.cuda)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print("device 0:", p.name, f"{p.total_memory / 2**30:.1f} GiB")
except Exception as e:
    print("torch import failed:", repr(e))
PY

# `import stepwatch` loads the generated stubs lazily: load them here.
IMPORT_CHECK='import grpc, stepwatch
from stepwatch._proto.stepwatch.v1 import ingest_pb2, ingest_pb2_grpc
print(stepwatch.__file__)'
if ! err="$(timeout -k 5 120 "$PYTHON" -c "$IMPORT_CHECK" 2>&1)"; then
  log "$err"
  if printf '%s' "$err" | grep -qi 'protobuf\|gencode\|runtime_version\|VersionError'; then
    die "the protobuf runtime cannot load the checked-in stubs (protobuf 6.31.1 gencode;" \
      "needs protobuf>=6.31.1,<8): carry the wheels bench/gpu-wheels.sh puts in .whl/"
  fi
  die "'import stepwatch' fails (see above); carry grpcio/protobuf wheels in .whl/ (bench/gpu-wheels.sh)"
fi
log "import stepwatch: $err"

# The agent's allocator model follows PyTorch's default caching allocator; with
# these set, the client sends no step-1 trace. Capture with the defaults.
for v in PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF; do
  if [ -n "${!v:-}" ]; then
    warn "unsetting $v='${!v}' (the fixtures are for the default allocator)"
    unset "$v"
  fi
done

# ----------------------------------------------------------------- agent ----
CANDIDATES=(.whl/stepwatch target/release/stepwatch)
[ "$FAKE" = 1 ] && CANDIDATES=(target/release/stepwatch .whl/stepwatch)
BIN="${STEPWATCH_BIN:-}"
if [ -z "$BIN" ]; then
  for c in "${CANDIDATES[@]}"; do
    if [ -x "$c" ]; then
      BIN="$REPO/$c"
      break
    fi
  done
fi
[ -n "$BIN" ] && [ -x "$BIN" ] \
  || die "no agent binary (looked at \$STEPWATCH_BIN, ${CANDIDATES[*]}):" \
    "cargo build --release, bench/gpu-wheels.sh, and carry .whl"
log "agent: $BIN ($("$BIN" --version 2>&1), $(stat -c %s "$BIN") bytes," \
  "sha256 $(sha256sum "$BIN" | cut -c1-16))"

HAVE_RECORD=0
HAVE_REPLAY=0
# (Whole outputs first: `cmd | grep -q` can fail under pipefail when grep exits early.)
help_text="$("$BIN" agent --help 2>&1)"
[[ "$help_text" == *--record* ]] && HAVE_RECORD=1
help_text="$("$BIN" --help 2>&1)"
[[ "$help_text" == *replay-record* ]] && HAVE_REPLAY=1
yes_no() { if [ "$1" = 1 ]; then echo yes; else echo MISSING; fi; }
log "agent --record: $(yes_no $HAVE_RECORD); replay-record: $(yes_no $HAVE_REPLAY)"
if [ $HAVE_RECORD = 0 ] || [ $HAVE_REPLAY = 0 ]; then
  if [ "$FAKE" = 1 ] || [ "${GPU_CAPTURE_ALLOW_NO_RECORD:-0}" = 1 ]; then
    warn "this agent lacks --record and/or replay-record: going on without them"
  else
    die "this agent lacks --record and/or replay-record (rebuild it;" \
      "GPU_CAPTURE_ALLOW_NO_RECORD=1 to capture reports anyway)"
  fi
fi

AGENT_ENV=(RUST_LOG="${RUST_LOG:-info}")
NVML_ARGS=()
if [ "$FAKE" = 1 ]; then
  NVML_DIR="$WORK/nvml"
  "$BIN" fake-gpu --dir "$NVML_DIR" init --gpus 1 --total-gib 141 || die "fake-gpu init failed"
  LIB="${STEPWATCH_FAKE_NVML_LIB:-$("$BIN" fake-gpu --dir "$NVML_DIR" lib-path 2>/dev/null)}"
  [ -n "$LIB" ] && [ -f "$LIB" ] || die "no fake NVML library next to $BIN (cargo build --release)"
  log "fake NVML: $LIB, state $NVML_DIR"
  NVML_ARGS=(--nvml-lib "$LIB")
  AGENT_ENV+=(STEPWATCH_FAKE_NVML_DIR="$NVML_DIR")
elif [[ "$(ldconfig -p 2>/dev/null)" != *libnvidia-ml.so.1* ]]; then
  # The driver may be mounted outside the loader's cache (e.g. /usr/local/nvidia).
  ld_path="${LD_LIBRARY_PATH:-}"
  for d in ${ld_path//:/ } /usr/local/nvidia/lib64 /usr/local/nvidia/lib \
    /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib; do
    if [ -e "$d/libnvidia-ml.so.1" ]; then
      NVML_ARGS=(--nvml-lib "$d/libnvidia-ml.so.1")
      break
    fi
  done
fi
if [ ${#NVML_ARGS[@]} -gt 0 ]; then
  log "NVML library: ${NVML_ARGS[1]}"
else
  log "NVML library: the agent's default, libnvidia-ml.so.1 (left to the loader)"
fi

if [ "$FAKE" = 0 ]; then
  "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
    || die "torch sees no CUDA device (use --fake for a dry run without a GPU)"
fi

# http [--wait S] [--pid PID] [--steps N] PORT PATH [FILE]: GET http://127.0.0.1:PORT/PATH,
# the body to FILE or stdout. With --wait, retries for up to S seconds until it answers 200
# (and, with --steps, a JSON body has steps_completed >= N), giving up early when PID exits;
# the last body got is kept either way. Exit 0 on success, 1 otherwise.
cat >"$WORK/sw_http_get.py" <<'PY'
import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("--wait", type=float, default=0.0)
ap.add_argument("--pid", type=int)
ap.add_argument("--steps", type=int)
ap.add_argument("port")
ap.add_argument("path")
ap.add_argument("file", nargs="?")
a = ap.parse_args()
deadline = time.monotonic() + a.wait
body, ok = None, False
while True:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{a.port}{a.path}", timeout=5) as r:
            body, ok = r.read(), r.status == 200
    except urllib.error.HTTPError as e:
        body, ok = e.read(), False
    except OSError as e:
        ok = False
        if body is None:
            body = f"(no answer: {e})".encode()
    if ok and a.steps is not None:
        try:
            ok = json.loads(body).get("steps_completed", 0) >= a.steps
        except ValueError:
            ok = False
    if ok or time.monotonic() >= deadline:
        break
    if a.pid is not None:
        try:
            os.kill(a.pid, 0)
        except OSError:
            break
    time.sleep(0.1)
if a.file:
    with open(a.file, "wb") as f:
        f.write(body or b"")
else:
    sys.stdout.buffer.write(body or b"")
sys.exit(0 if ok else 1)
PY
http() { "$PYTHON" "$WORK/sw_http_get.py" "$@"; }

free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# -------------------------------------------------------------- training ----
TRAIN_TIMEOUT="${GPU_CAPTURE_TRAIN_TIMEOUT:-150}"
if [ "$FAKE" = 1 ]; then
  TRAIN_ARGS=(--device cpu --layers 2 --hidden 64 --heads 4 --seq-len 64 --batch 2 --vocab 512)
else
  TRAIN_ARGS=(--device cuda)
fi
# shellcheck disable=SC2206 # word splitting is the point
TRAIN_ARGS+=(${GPU_TRAIN_ARGS:-})
RUNS="${GPU_CAPTURE_RUNS:-adamw sgd}"
STEPS=12 # what the report must reach: gpu_train.py's default, or the last --steps given
prev=""
for a in "${TRAIN_ARGS[@]}"; do
  [ "$prev" = --steps ] && STEPS="$a"
  prev="$a"
done
RECORDS=()

capture() { # capture RUN: one agent, one training run
  local run="$1" opt job port sock rec alog steps
  opt="$run"
  job="gpu-capture-$run"
  port="$(free_port)" || return 1
  sock="$WORK/$run.sock"
  rec="$OUT/$run.jsonl"
  alog="$WORK/$run-agent.log"
  local rec_args=()
  [ $HAVE_RECORD = 1 ] && rec_args=(--record "$rec")

  log "=== run $run: agent on 127.0.0.1:$port, socket $sock${rec_args:+, record $rec}"
  env "${AGENT_ENV[@]}" "$BIN" agent --socket "$sock" --http-listen "127.0.0.1:$port" \
    --node-name gpu-capture --process-interval 250ms "${NVML_ARGS[@]}" "${rec_args[@]}" \
    >"$alog" 2>&1 &
  AGENT_PID=$!
  local t_start=$SECONDS
  # /readyz is 200 without NVML too; its body's "nvml: up" line is what the capture needs.
  if http --wait 20 --pid "$AGENT_PID" "$port" /readyz 2>/dev/null | grep -qx 'nvml: up'; then
    log "agent ready after ~$((SECONDS - t_start)) s"
  elif ! kill -0 "$AGENT_PID" 2>/dev/null; then
    log "agent exited at start; its log:"
    cat "$alog"
    stop_agent
    return 1
  else
    warn "agent not ready after 20 s: /readyz says '$(http "$port" /readyz 2>&1)'; training anyway"
  fi

  log "training: gpu_train.py --optimizer $opt --job-id $job ${TRAIN_ARGS[*]}"
  timeout -k 10 "$TRAIN_TIMEOUT" "$PYTHON" python/tools/gpu_train.py --optimizer "$opt" \
    --job-id "$job" --endpoint "unix://$sock" "${TRAIN_ARGS[@]}"
  local train_rc=$?
  log "gpu_train.py exit status $train_rc"

  # The agent applies markers asynchronously: wait (bounded) until it has all steps.
  local wait_s=10
  [ $train_rc = 0 ] || wait_s=2
  http --wait "$wait_s" --steps "$STEPS" "$port" "/api/v1/jobs/$job/ranks/0" \
    "$OUT/$run-report.json" 2>/dev/null
  steps="$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["steps_completed"])' \
    "$OUT/$run-report.json" 2>/dev/null || echo none)"
  if [ -n "$steps" ] && [ "$steps" != none ]; then
    log "saved $run-report.json ($steps steps completed)"
  else
    warn "no report for $job/0: $(head -c 300 "$OUT/$run-report.json" 2>/dev/null)"
    rm -f "$OUT/$run-report.json"
  fi
  {
    echo "# ===== run $run: /metrics at $(date -u +%FT%TZ)"
    http "$port" /metrics || echo "# (metrics unavailable)"
  } >>"$OUT/metrics.txt" 2>&1
  stop_agent
  log "agent log ($run), last 200 lines:"
  tail -n 200 "$alog"

  if [ -f "$rec" ]; then
    RECORDS+=("$run")
    log "record $rec: $(stat -c %s "$rec") bytes"
    "$PYTHON" - "$rec" <<'PY'
import collections
import json
import sys

kinds = collections.Counter()
bad = 0
with open(sys.argv[1]) as f:
    for line in f:
        try:
            obj = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(obj, dict):
            tag = next((obj[k] for k in ("kind", "type", "event") if isinstance(obj.get(k), str)), None)
            kinds[tag or "/".join(sorted(obj))[:60]] += 1
        else:
            kinds[type(obj).__name__] += 1
print("record lines by kind:", dict(kinds), "unparsable:", bad)
PY
  elif [ $HAVE_RECORD = 1 ]; then
    warn "the agent wrote no record at $rec"
  fi
  [ $train_rc = 0 ] && [ -s "$OUT/$run-report.json" ]
}

for run in $RUNS; do
  if ! capture "$run"; then
    FAILED=1
    warn "run $run failed"
  fi
  stop_agent
done

# --------------------------------------------------------------- summary ----
{
  echo "# gpu-capture $(date -u +%FT%TZ), mode $([ "$FAKE" = 1 ] && echo fake || echo real)"
  for run in $RUNS; do
    [ -f "$OUT/$run-report.json" ] || continue
    echo "## $run: the rank's report (prediction vs steady state)"
    "$PYTHON" - "$OUT/$run-report.json" <<'PY'
import json
import sys

r = json.load(open(sys.argv[1]))
a = r.get("analysis") or {}


def show(name, obj, depth=0):
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k != "phases":  # per-phase figures stay in the report
                show(f"{name}.{k}", v, depth + 1)
    elif isinstance(obj, list):
        print(f"  {name} = [{len(obj)} items]")
    else:
        print(f"  {name} = {obj}")


for key in ("job", "rank", "steps_completed", "ooms", "advisories", "prediction_before_step2"):
    show(key, r.get(key))
for key in ("capacity_bytes", "other_process_bytes", "prediction", "first_step", "steady"):
    show(f"analysis.{key}", a.get(key))
show("analysis.steady_state", a.get("steady_state"))
PY
  done
} >>"$OUT/summary.txt" 2>&1
if [ $HAVE_REPLAY = 1 ]; then
  for run in "${RECORDS[@]}"; do
    log "replay-record $run.jsonl"
    {
      echo "## $run: stepwatch replay-record $run.jsonl"
      timeout -k 5 120 "$BIN" replay-record "$OUT/$run.jsonl"
      echo "# exit status $?"
    } >>"$OUT/summary.txt" 2>&1
  done
fi
log "summary.txt:"
cat "$OUT/summary.txt"

# Files come back only up to 16 MiB each.
for run in "${RECORDS[@]}"; do
  f="$OUT/$run.jsonl"
  if [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt $((15 * 1024 * 1024)) ]; then
    gzip -9 "$f" && log "gzipped $f: $(stat -c %s "$f.gz") bytes"
  fi
done
n=$(find "$OUT" -maxdepth 1 -type f | wc -l)
[ "$n" -le 8 ] || warn "$n files in $OUT: only 8 come back"
exit $FAILED
