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
REPO="$PWD"
TOTAL="${1:-5.16}"; shift || true
BATCHES=("$@"); [ ${#BATCHES[@]} -gt 0 ] || BATCHES=(16384 14516 13243 11533 11000)
PY="${PY:-$HOME/.cache/stepwatch/py-venv/bin/python}"
BIN="${BIN:-${CARGO_TARGET_DIR:-target}/debug/stepwatch}"
WORK="$(mktemp -d)"; APID=
cleanup() { [ -n "$APID" ] && kill "$APID" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
cat >"$WORK/train.py" <<'PY'
import sys, torch, stepwatch
width, layers, batch, steps = (int(a) for a in sys.argv[1:5])
with torch.device("cuda"):
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods)
opt = torch.optim.AdamW(model.parameters())
stepwatch.watch(model, opt, micro_batch_size=batch)
for step in range(1, steps + 1):
    model(torch.randn(batch, width, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} done", flush=True)
stepwatch.flush(5)
PY
LIB="$("$BIN" fake-gpu --dir "$WORK/probe" lib-path)"
for B in "${BATCHES[@]}"; do
  D="$WORK/b$B"; mkdir -p "$D"
  "$BIN" fake-gpu --dir "$D/nvml" init --gpus 1 --total-gib "$TOTAL" >/dev/null
  PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
  STEPWATCH_FAKE_NVML_DIR="$D/nvml" "$BIN" agent --nvml-lib "$LIB" --socket "$D/a.sock" \
    --http-listen "127.0.0.1:$PORT" --node-name fit >"$D/agent.log" 2>&1 &
  APID=$!
  for _ in $(seq 200); do curl -sf \"127.0.0.1:$PORT/readyz\" | grep -qx 'nvml: up' && break; sleep 0.1; done
  rc=0
  STEPWATCH_FAKE_NVML_DIR="$D/nvml" STEPWATCH_ENDPOINT="unix://$D/a.sock" STEPWATCH_JOB_ID=fit \
    PYTHONPATH="$REPO/python" timeout 300 crates/fake-cuda/fake-cuda run --quiet --python "$PY" \
    --gpus 1 -- "$PY" "$WORK/train.py" 4096 8 "$B" 3 >"$D/job.out" 2>"$D/job.err" || rc=$?
  # The stream has closed when the job exits; the report is complete.
  curl -sf "127.0.0.1:$PORT/api/v1/jobs/fit/ranks/0" >"$D/report.json" || echo '{}' >"$D/report.json"
  kill "$APID"; wait "$APID" 2>/dev/null || true; APID=
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
