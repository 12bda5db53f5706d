#!/usr/bin/env bash
# What-would-fit advice against real PyTorch (fake CUDA): does the micro-batch
# the agent names fit?
#
#   bench/fit-advice.sh [TOTAL_GIB=5.16] [BATCH ...=16384 14516 13243 11533 11000]
#
# For each micro-batch, a fresh agent on one fake GPU of TOTAL_GIB (512 MiB of
# it driver-reserved) watches an 8-layer, 4096-wide MLP with AdamW for 3 steps
# (stepwatch.watch(..., micro_batch_size=BATCH)). Prints whether the job
# finished, the prediction frozen at step 2, its what_would_fit, and the last
# advisory. Needs a built agent (cargo build -p stepwatch; BIN=path
# overrides) and the shared venv's torch (PY=path overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/fake-agent.sh
TOTAL="${1:-5.16}"; shift || true
BATCHES=("$@"); [ ${#BATCHES[@]} -gt 0 ] || BATCHES=(16384 14516 13243 11533 11000)
PY="${PY:-$HOME/.cache/stepwatch/py-venv/bin/python}"
BIN="${BIN:-${CARGO_TARGET_DIR:-target}/debug/stepwatch}"
WORK="$(mktemp -d)"; PID=
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
for B in "${BATCHES[@]}"; do
  D="$WORK/b$B"; mkdir -p "$D"
  "$BIN" fake-gpu --dir "$D" init --gpus 1 --total-gib "$TOTAL" >/dev/null
  agent_on_fake_gpus "$D" 100 --node-name fit
  wait_nvml_up || { echo "the agent did not sample the fake GPU:"; tail -20 "$D/agent.log"; exit 1; }
  rc=0
  fake_cuda_job "$D" 1 fit "$PY" bench/mlp_job.py 4096 8 "$B" 3 || rc=$?
  # The stream has closed when the job exits; the report is complete.
  curl -sf "127.0.0.1:$PORT/api/v1/jobs/fit/ranks/0" >"$D/report.json" || echo '{}' >"$D/report.json"
  kill "$PID"; wait "$PID" 2>/dev/null || true; PID=
  "$PY" - "$B" "$rc" "$D/report.json" "$D/job.out" <<'PY'
import json, sys
batch, rc, report, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
r = json.load(open(report))
p = r.get("prediction_before_step2") or (r.get("analysis") or {}).get("prediction") or {}
f = p.get("what_would_fit") or {}
done = open(out).read().count("done")
gb = lambda b: "-" if b is None else f"{b / 1e9:.2f} GB"
print(f"batch {batch}: {'fits' if rc == 0 else f'OOM (exit {rc})'} after {done} steps; "
      f"predicted {gb(p.get('predicted_peak_bytes'))}, headroom {gb(p.get('headroom_bytes'))}; "
      f"per sample {f.get('activation_bytes_per_sample')} B; "
      f"fits with micro-batch {f.get('fits_with_micro_batch_size')}, "
      f"sharding {f.get('fits_with_sharding_factor')}")
adv = r.get("advisories") or []
if adv:
    print("  last advisory:", adv[-1]["message"])
PY
done
