#!/usr/bin/env bash
# What the web page at / costs the agent: `stepwatch demo` (2 fake GPUs, the
# healthy and the doomed job), then the agent's CPU (utime+stime from
# /proc/PID/stat) over SECONDS with no page open, with the node view open in
# headless Chromium, and with a rank's step-anatomy view open; and the bytes
# one update of each view fetches (the page's own requests, replayed once).
#
#   bench/ui-cost.sh [SECONDS]     # default 60; BIN=path skips the build
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH="${1:-60}"
if [ -z "${BIN:-}" ]; then
  cargo build --release --locked -p stepwatch -p fake-nvml >/dev/null
  BIN=target/release/stepwatch
fi
command -v chromium >/dev/null || { echo "needs Debian's chromium" >&2; exit 1; }
DIR="$(mktemp -d)"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$BIN" demo --http-listen "127.0.0.1:$PORT" --every 3600 >"$DIR/demo.log" 2>&1 &
DEMO=$!
BROWSER=""
cleanup() {
  [ -z "$BROWSER" ] || kill "$BROWSER" 2>/dev/null || true
  kill "$DEMO" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT
BASE="http://127.0.0.1:$PORT"
for _ in $(seq 300); do curl -sf "$BASE/readyz" >/dev/null && break; sleep 0.1; done
AGENT=$(pgrep -P "$DEMO" -f "stepwatch agent" | head -1)
[ -n "$AGENT" ] || { echo "no agent under the demo (pid $DEMO)" >&2; exit 1; }
# Let both jobs reach steady state.
sleep 15

ticks() { awk '{print $14 + $15}' "/proc/$AGENT/stat"; }
hz=$(getconf CLK_TCK)
measure() { # label
  local t0 t1
  t0=$(ticks)
  sleep "$SECONDS_EACH"
  t1=$(ticks)
  python3 -c "print(f'$1: agent CPU {100 * ($t1 - $t0) / $hz / $SECONDS_EACH:.2f}% of one core over $SECONDS_EACH s')"
}
page() { # hash
  chromium --headless --no-sandbox --disable-gpu --remote-debugging-port=0 \
    --user-data-dir="$DIR/profile" --window-size=1280,1000 "$BASE/#$1" >/dev/null 2>&1 &
  BROWSER=$!
  sleep 5
}
close_page() { kill "$BROWSER"; wait "$BROWSER" 2>/dev/null || true; BROWSER=""; }


measure "no page open"
page "/"
measure "node view open (1 update/s)"
close_page
page "/jobs/healthy-llm-1/ranks/0"
measure "rank view open (1 update/s)"
close_page

# After the CPU runs, so that the 60 s window is full (300 buckets per GPU).
# Bytes of one update of each view: the requests app.js makes, replayed.
python3 - "$BASE" <<'EOF'
import json, sys, urllib.request
base = sys.argv[1]
def get(path):
    with urllib.request.urlopen(base + path) as r:
        body = r.read()
    return len(body), json.loads(body)
node = 0
n, gpus = get("/api/v1/gpus"); node += n
n, jobs = get("/api/v1/jobs"); node += n
for g in gpus["gpus"]:
    n, _ = get(f"/api/v1/gpus/{g['uuid']}/samples?seconds=60&points=300"); node += n
for j in jobs["jobs"]:
    n, _ = get(f"/api/v1/jobs/{j['job']}"); node += n
print(f"node view: {node} bytes per update ({len(gpus['gpus'])} GPUs, {len(jobs['jobs'])} jobs)")
rank = 0
n, rep = get("/api/v1/jobs/healthy-llm-1/ranks/0?steps=3"); rank += n
n, _ = get("/api/v1/jobs"); rank += n
for s in rep["steps"]:
    if s["step"] == 1 or s is rep["steps"][-2]:
        if s["duration_seconds"]:
            to = int(s["begin_monotonic_ns"] + s["duration_seconds"] * 1e9) + 1
            n, _ = get(f"/api/v1/gpus/{rep['info']['gpu_uuid']}/samples?from_ns={s['begin_monotonic_ns']}&to_ns={to}&points=200")
            rank += n
print(f"rank view (healthy-llm-1 rank 0): {rank} bytes per update")
size = lambda path: len(urllib.request.urlopen(base + path).read())
i, a, c = size("/"), size("/ui/app.js"), size("/ui/style.css")
print(f"page load: {i + a + c} bytes (index {i}, app.js {a}, style.css {c})")
EOF
