#!/usr/bin/env bash
# Rank divergence against real PyTorch (fake CUDA): is the rank with the
# heavier forward named, and only it?
#
#   bench/divergence-check.sh [BATCH=4096] [HEAVY_RANK=3]
#
# Four DDP ranks (torchrun on four fake GPUs of 20 GiB) train an 8-layer,
# 4096-wide MLP with AdamW for 3 steps; HEAVY_RANK uses a micro-batch 24%
# larger (the same optimizer state on every rank). Prints the job's
# divergence (/api/v1/jobs/div), each rank's advisories, and the outlier
# series. Needs a built agent (cargo build -p stepwatch; BIN=path overrides)
# and the shared venv's torch (PY=path overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/fake-agent.sh
BATCH="${1:-4096}"; HEAVY="${2:-3}"
PY="${PY:-$HOME/.cache/stepwatch/py-venv/bin/python}"
BIN="${BIN:-${CARGO_TARGET_DIR:-target}/debug/stepwatch}"
D="$(mktemp -d)"; PID=
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null; rm -rf "$D"; }
trap cleanup EXIT
"$BIN" fake-gpu --dir "$D" init --gpus 4 --total-gib 20 >/dev/null
agent_on_fake_gpus "$D" 100 --node-name div
wait_nvml_up || { echo "the agent did not sample the fake GPUs:"; tail -20 "$D/agent.log"; exit 1; }
fake_cuda_job "$D" 4 div "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 \
  bench/mlp_job.py 4096 8 "$BATCH" 3 "$HEAVY" ||
  { echo "the job failed:"; tail -20 "$D/job.err"; exit 1; }
curl -sf "127.0.0.1:$PORT/api/v1/jobs/div" >"$D/job.json"
for r in 0 1 2 3; do curl -sf "127.0.0.1:$PORT/api/v1/jobs/div/ranks/$r" >"$D/r$r.json"; done
curl -sf "127.0.0.1:$PORT/metrics" | grep -E '^stepwatch_(job_rank_outlier|rank_first_step_activation)' || true
"$PY" - "$D" <<'PY'
import json, sys
d = sys.argv[1]
div = json.load(open(f"{d}/job.json"))["divergence"]
for fig, src in (("peak", "peak_source"), ("activation", "activation_source"), ("steady", "steady_source")):
    s = div.get(fig)
    if s:
        outl = [(o["rank"], f"{100 * o['deviation']:+.1f}%") for o in s["outliers"]]
        print(f"{fig} ({div.get(src)}): median {s['median'] / 1e9:.3f} GB, spread {100 * s['spread']:.1f}%, outliers {outl}")
print("named:", [(n["rank"], n["figure"], f"{100 * n['deviation']:+.1f}%") for n in div["named"]])
for r in range(4):
    for a in json.load(open(f"{d}/r{r}.json"))["advisories"]:
        print(f"rank {r} advisory ({a['kind']}, step {a['step']}): {a['message']}")
PY
