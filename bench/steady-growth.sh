#!/usr/bin/env bash
# Corpus jobs run for many steps on a roomy fake GPU: does the agent report
# memory growth where none is? (issue 30: no growth advisory on the corpus jobs
# run for 50 steps.)
#
#   bench/steady-growth.sh                  # the first 18 jobs of bench/torch-jobs/jobs.json
#                                           # and the evaluation/checkpoint jobs, 50 steps each
#   bench/steady-growth.sh --jobs a,b       # a subset
#   bench/steady-growth.sh --steps 200      # longer
#   bench/steady-growth.sh --help           # every flag
#
# One job at a time, each with its own agent on fresh fake NVML GPUs (80 GiB
# usable), unmodified PyTorch on fake CUDA. Per rank: whether a MEMORY_GROWTH
# advisory or a growth forecast came, and the largest growth slope the agent
# computed (bench/steady_growth.py's docstring has the definitions); a table,
# and target/steady-growth.json.
#
# Knobs: PYTHON (default: the test venv ~/.cache/stepwatch/py-venv, else
# python3), STEPWATCH_BIN (default target/debug/stepwatch, built with cargo
# build -p stepwatch when missing), FAKE_CUDA, STEPWATCH_FAKE_CUDA_CACHE.
#
# Exit status: 0 when no rank got a growth advisory or forecast; 1 on a
# harness error; 2 on bad usage; 3 when some rank got one.
set -u -o pipefail

# torch-accuracy.sh finds the Python and the agent (building it when missing).
exec "$(dirname "${BASH_SOURCE[0]}")/torch-accuracy.sh" --steady-growth "$@"
