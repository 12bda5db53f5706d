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
REPO="$PWD"
BATCH="${1:-4096}"; HEAVY="${2:-3}"
PY="${PY:-$HOME/.cache/stepwatch/py-venv/bin/python}"
BIN="${BIN:-${CARGO_TARGET_DIR:-target}/debug/stepwatch}"
D="$(mktemp -d)"; APID=
cleanup() { [ -n "$APID" ] && kill "$APID" 2>/dev/null; rm -rf "$D"; }
trap cleanup EXIT
cat >"$D/train.py" <<'PY'
import os, sys, torch, torch.distributed as dist, stepwatch
from torch.nn.parallel import DistributedDataParallel as DDP
width, layers, batch, heavy, steps = (int(a) for a in sys.argv[1:6])
dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
b = batch * 124 // 100 if rank == heavy else batch
with torch.device("cuda"):
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*mods))
opt = torch.optim.AdamW(model.parameters())
stepwatch.watch(model, opt, micro_batch_size=b)
for step in range(1, steps + 1):
    model(torch.randn(b, width, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
stepwatch.flush(5)
dist.destroy_process_group()
PY
"$BIN" fake-gpu --dir "$D/nvml" init --gpus 4 --total-gib 20 >/dev/null
LIB="$("$BIN" fake-gpu --dir "$D/probe" lib-path)"
PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
STEPWATCH_FAKE_NVML_DIR="$D/nvml" "$BIN" agent --nvml-lib "$LIB" --socket "$D/a.sock" \
  --http-listen "127.0.0.1:$PORT" --node-name div >"$D/agent.log" 2>&1 &
APID=$!
for _ in $(seq 200); do curl -sf \"127.0.0.1:$PORT/readyz\" | grep -qx 'nvml: up' && break; sleep 0.1; done
STEPWATCH_FAKE_NVML_DIR="$D/nvml" STEPWATCH_ENDPOINT="unix://$D/a.sock" STEPWATCH_JOB_ID=div \
  PYTHONPATH="$REPO/python" timeout 300 crates/fake-cuda/fake-cuda run --quiet --python "$PY" \
  --gpus 4 -- "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 \
  "$D/train.py" 4096 8 "$BATCH" "$HEAVY" 3 >"$D/job.out" 2>"$D/job.err" ||
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
