#!/usr/bin/env bash
# Step-2 prediction accuracy on real PyTorch jobs, on fake GPUs:
#
#   bench/torch-accuracy.sh                    # every job of bench/torch-jobs/jobs.json (45)
#   bench/torch-accuracy.sh --set held_out     # the held-out set (what CI runs), or tuning
#   bench/torch-accuracy.sh --jobs a,b         # a subset (--list shows them and their sets)
#   bench/torch-accuracy.sh --check            # missed targets make the exit status 3
#   bench/torch-accuracy.sh --help             # every flag
#
# Each job runs, with unmodified PyTorch on fake CUDA (crates/fake-cuda) against
# `stepwatch agent --record` on fake NVML, at several GPU capacities around its
# true steady-state peak (found by a calibration run on roomy GPUs): fits with
# under 2%, 5% and 10% to spare, step 2 failing, and the fragmentation case
# (allocated memory fits, reserved does not); each twice, with step 1's
# allocator trace (`trace`, the client's default) and with markers only
# (`markers`, STEPWATCH_ALLOCATOR_TRACE=0). Truth is what happened: the fake
# GPU's NVML peak over steps 2..k from fake CUDA's usage log, or the step in
# which PyTorch raised OutOfMemoryError. It prints a line per run, a table and
# a summary per variant against the targets (trace: median |error| <= 1%,
# max <= 3%; markers: <= 2%, <= 5%; every step-2 OOM warned before step 2; no
# OOM warning with >= 5% true headroom), each for the tuning and the held-out
# set apart (bench/torch-jobs/split.py fixed the split), and writes
# target/torch-accuracy.json (one object per rank and run, with its set) and
# target/torch-accuracy-summary.json (per set and estimator). Beside
# stepwatch it runs two peer estimators on each job, once, on a roomy GPU:
# PyTorch's MemTracker and accelerate's estimate-memory (--no-peers: not).
# bench/torch_accuracy.py's docstring has the definitions.
#
# On the 2-vCPU VM, 2 runs at a time (--parallel), kernels of 50 us
# (--kernel-time), while other builds shared the VM (load average 5-10): the
# held-out set (24 jobs, 272 runs with the peers) 29 minutes, the tuning set
# (20 jobs, 224 runs) 27, all 44 jobs about 55. CI runs the held-out set only.
# Each run has its own agent and fake GPUs; the harness stops every process it
# started on exit, SIGINT and SIGTERM. --keep keeps each run's agent log,
# record, reports, the job's output and fake CUDA's usage log (kept anyway on
# a harness error).
#
# Knobs: PYTHON (default: the test venv ~/.cache/stepwatch/py-venv, else
# python3; it runs the harness and the jobs), STEPWATCH_BIN (the agent;
# default target/debug/stepwatch, brought up to date with `cargo build -p
# stepwatch` first, so that a run never measures a stale build; a named
# STEPWATCH_BIN is used as it is), FAKE_CUDA (default crates/fake-cuda/fake-cuda).
#
# bench/steady-growth.sh runs its own harness (bench/steady_growth.py) through
# this script's set-up: --steady-growth, first, selects it.
#
# Exit status: 0; 1 on a harness error (a job failed other than by OOM, the
# agent did not come up, truth could not be read); 2 on bad usage; 3 with
# --check when a target is missed.
set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 1

if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x "$HOME/.cache/stepwatch/py-venv/bin/python" ] && PYTHON="$HOME/.cache/stepwatch/py-venv/bin/python"
fi
command -v "$PYTHON" >/dev/null || {
  echo "torch-accuracy: no python at '$PYTHON' (set PYTHON=...)" >&2
  exit 1
}

HARNESS=torch_accuracy.py
if [ "${1:-}" = --steady-growth ]; then
  HARNESS=steady_growth.py
  shift
fi

want_build=1
for arg in "$@"; do
  case "$arg" in
    -h | --help | --list) want_build=0 ;;
  esac
done

BIN="${STEPWATCH_BIN:-$REPO/target/debug/stepwatch}"
if [ -n "${STEPWATCH_BIN:-}" ]; then
  if [ "$want_build" = 1 ] && [ ! -x "$BIN" ]; then
    echo "torch-accuracy: STEPWATCH_BIN=$BIN is not an executable" >&2
    exit 1
  fi
elif [ "$want_build" = 1 ]; then
  echo "torch-accuracy: cargo build -p stepwatch (the agent at $BIN)" >&2
  timeout -k 10 3600 cargo build -p stepwatch || {
    echo "torch-accuracy: cargo build -p stepwatch failed" >&2
    exit 1
  }
fi

# The harness owns its children (agents, jobs) and stops them on exit and on
# SIGINT/SIGTERM; exec so that signals reach it directly.
exec "$PYTHON" "$REPO/bench/$HARNESS" --bin "$BIN" --python "$PYTHON" "$@"
