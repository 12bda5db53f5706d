# Sourced by bench scripts (from the repository root): the release agent, an agent on
# fake GPUs, and a job on fake CUDA that marks to it.

# BIN: the release `stepwatch`, built here, unless BIN is set (to compare two binaries).
# CARGO_TARGET_DIR is honoured.
release_agent() {
  if [ -z "${BIN:-}" ]; then
    cargo build --release --locked -p stepwatch >/dev/null 2>&1 || cargo build --release --locked -p stepwatch
    BIN="${CARGO_TARGET_DIR:-target}/release/stepwatch"
  fi
}

# start_fake_agent DIR GPUS HZ [AGENT_FLAG...]: GPUS fake GPUs in DIR and `$BIN agent` on
# them (agent_on_fake_gpus).
start_fake_agent() {
  "$BIN" fake-gpu --dir "$1" init --gpus "$2" >/dev/null
  agent_on_fake_gpus "$1" "${@:3}"
}

# agent_on_fake_gpus DIR HZ [AGENT_FLAG...]: `$BIN agent` at HZ on the fake GPUs of DIR
# (`fake-gpu --dir DIR init`), in the background, its socket DIR/s.sock and its log
# DIR/agent.log; sets PID and PORT (its HTTP port).
agent_on_fake_gpus() {
  local dir="$1" hz="$2" lib
  shift 2
  lib="$("$BIN" fake-gpu --dir "$dir" lib-path)"
  PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  STEPWATCH_FAKE_NVML_DIR="$dir" "$BIN" agent --socket "$dir/s.sock" --http-listen "127.0.0.1:$PORT" \
    --nvml-lib "$lib" --sample-hz "$hz" "$@" 2>"$dir/agent.log" &
  PID=$!
}

# wait_nvml_up: until the agent (PORT) samples its GPUs (/readyz says `nvml: up`), 20 s at
# the most; 1 when it does not.
wait_nvml_up() {
  local i
  for ((i = 0; i < 200; i++)); do
    curl -sf "127.0.0.1:$PORT/readyz" | grep -qx 'nvml: up' && return 0
    sleep 0.1
  done
  return 1
}

# fake_cuda_job DIR GPUS JOB CMD...: CMD on GPUS fake CUDA devices of the fake GPUs of DIR,
# marking to the agent of agent_on_fake_gpus DIR as job JOB; its stdout in DIR/job.out, its
# stderr in DIR/job.err, 300 s at the most. PY: the Python whose torch fake CUDA builds for.
fake_cuda_job() {
  local dir="$1" gpus="$2" job="$3"
  shift 3
  STEPWATCH_FAKE_NVML_DIR="$dir" STEPWATCH_ENDPOINT="unix://$dir/s.sock" STEPWATCH_JOB_ID="$job" \
    PYTHONPATH="$PWD/python" timeout 300 crates/fake-cuda/fake-cuda run --quiet --python "$PY" \
    --gpus "$gpus" -- "$@" >"$dir/job.out" 2>"$dir/job.err"
}
