#!/usr/bin/env bash
# Prepares what a GPU session carries for bench/gpu-capture.sh. Run HERE (with
# network), from anywhere in the repo:
#
#   bench/gpu-wheels.sh
#
# 1. Downloads into .whl/ (git-ignored) the cp312 manylinux x86_64 wheels of
#    grpcio and protobuf that the Python client needs, and typing_extensions
#    (grpcio's one requirement; pure Python), at the versions the client's
#    tests run with (GRPCIO_VERSION, PROTOBUF_VERSION, TYPING_EXTENSIONS_VERSION
#    override; they must satisfy python/pyproject.toml: grpcio>=1.76.0,
#    protobuf>=6.31.1,<8). The GPU image has all three, at versions nobody has
#    read; the wheels make the run independent of them.
# 2. Copies the agent (target/release/stepwatch, or $STEPWATCH_BIN) into
#    .whl/stepwatch with its debug info stripped: the release build keeps line
#    tables (~56 MB), the stripped copy is ~9 MB, and the device tool carries
#    at most 64 MiB per call, working tree included.
#
# Then one carry path, ".whl", holds everything the capture needs. Prints the
# sizes.
set -euo pipefail
cd "$(dirname "$0")/.."

GRPCIO_VERSION="${GRPCIO_VERSION:-1.85.3}"
PROTOBUF_VERSION="${PROTOBUF_VERSION:-6.33.6}"
TYPING_EXTENSIONS_VERSION="${TYPING_EXTENSIONS_VERSION:-4.16.0}"
WHL=.whl
LIMIT=$((64 * 1024 * 1024))

# A pip that can download: the client's test venv, else python3's.
PIP=()
for py in "${PYTHON:-}" "$HOME/.cache/stepwatch/py-venv/bin/python" python3; do
  if [ -n "$py" ] && "$py" -m pip --version >/dev/null 2>&1; then
    PIP=("$py" -m pip)
    break
  fi
done
if [ ${#PIP[@]} -eq 0 ]; then
  echo "gpu-wheels: no python with pip found (set PYTHON=...)" >&2
  exit 1
fi

mkdir -p "$WHL"
# Exactly one version of each: two make the --target install there fail.
rm -f "$WHL"/grpcio-*.whl "$WHL"/protobuf-*.whl "$WHL"/typing_extensions-*.whl
"${PIP[@]}" download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 \
  -d "$WHL" "grpcio==$GRPCIO_VERSION" "protobuf==$PROTOBUF_VERSION" \
  "typing_extensions==$TYPING_EXTENSIONS_VERSION"

BIN="${STEPWATCH_BIN:-target/release/stepwatch}"
if [ -x "$BIN" ]; then
  strip -o "$WHL/stepwatch.tmp" "$BIN" 2>/dev/null || objcopy --strip-debug "$BIN" "$WHL/stepwatch.tmp"
  chmod 0755 "$WHL/stepwatch.tmp"
  mv "$WHL/stepwatch.tmp" "$WHL/stepwatch"
  if ! "$WHL/stepwatch" --version >/dev/null; then
    echo "gpu-wheels: the stripped agent $WHL/stepwatch does not run" >&2
    exit 1
  fi
  if [[ "$("$BIN" agent --help 2>&1)" != *--record* ]]; then
    echo "gpu-wheels: WARNING: $BIN has no 'agent --record' yet; gpu-capture.sh needs it" >&2
  fi
else
  echo "gpu-wheels: WARNING: no agent at $BIN (cargo build --release); .whl/stepwatch not made" >&2
fi

echo "carried in $WHL/:"
ls -l "$WHL"
whl_bytes=$(du -cb "$WHL"/* | tail -1 | cut -f1)
tree_bytes=$( (git ls-files -z; git ls-files -z --others --exclude-standard) \
  | xargs -0 du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s + 0}')
total=$((whl_bytes + tree_bytes))
printf 'sizes: %s %d bytes, working tree %d bytes, together %d bytes (%d%% of the 64 MiB carry limit)\n' \
  "$WHL" "$whl_bytes" "$tree_bytes" "$total" $((100 * total / LIMIT))
if [ "$total" -ge "$LIMIT" ]; then
  echo "gpu-wheels: over the 64 MiB carry limit" >&2
  exit 1
fi
