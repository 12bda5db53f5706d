# Sourced by bench scripts (from the repository root): the release agent and an agent
# on fake GPUs.

# BIN: the release `stepwatch`, built here, unless BIN is set (to compare two binaries).
# CARGO_TARGET_DIR is honoured.
release_agent() {
  if [ -z "${BIN:-}" ]; then
    cargo build --release --locked -p stepwatch >/dev/null 2>&1 || cargo build --release --locked -p stepwatch
    BIN="${CARGO_TARGET_DIR:-target}/release/stepwatch"
  fi
}

# start_fake_agent DIR GPUS HZ: GPUS fake GPUs in DIR and `$BIN agent` on them at HZ,
# in the background, its log in DIR/agent.log; sets PID and PORT (its HTTP port).
start_fake_agent() {
  local dir="$1" lib
  "$BIN" fake-gpu --dir "$dir" init --gpus "$2" >/dev/null
  lib="$("$BIN" fake-gpu --dir "$dir" lib-path)"
  PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  STEPWATCH_FAKE_NVML_DIR="$dir" "$BIN" agent --socket "$dir/s.sock" --http-listen "127.0.0.1:$PORT" \
    --nvml-lib "$lib" --sample-hz "$3" 2>"$dir/agent.log" &
  PID=$!
}
