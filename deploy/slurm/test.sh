#!/usr/bin/env bash
# Slurm end to end (part of scripts/test): a one-node Slurm cluster (Debian's slurmctld,
# slurmd and munge, installed here when missing) with two fake GPUs as GRES, the
# prolog/epilog of this directory, and the agent on fake NVML with --slurm-job-mapping-dir;
# an sbatch job trains unmodified PyTorch on fake CUDA with the Python client.
# See test_slurm.py for what is checked. STEPWATCH_SLURM_PROCTRACK=proctrack/linuxproc runs
# the cluster without job cgroups (the agent then finds the job from the slurmstepd
# the process descends from).
#
# Needs root (slurmd starts jobs as their users and makes their cgroups; the test adds
# the system user stepwatch-slurm-test), the venv of python/run-tests.sh (torch, the
# client, pytest) and a built agent ($STEPWATCH_BIN or target/debug/stepwatch).
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$self")/../.."

# Resolved before sudo, which changes $HOME: the caller's venv and agent.
export STEPWATCH_PY_VENV="${STEPWATCH_PY_VENV:-$HOME/.cache/stepwatch/py-venv}"
export STEPWATCH_BIN="${STEPWATCH_BIN:-$PWD/target/debug/stepwatch}"
if [ "$(id -u)" -ne 0 ]; then
  exec sudo --preserve-env=STEPWATCH_BIN,STEPWATCH_PY_VENV,STEPWATCH_KEEP_SLURM_DIR,STEPWATCH_SLURM_PROCTRACK "$self" "$@"
fi

packages=()
command -v slurmctld >/dev/null || packages+=(slurmctld)
command -v slurmd >/dev/null || packages+=(slurmd)
command -v srun >/dev/null || packages+=(slurm-client)
command -v munged >/dev/null || packages+=(munge)
if [ ${#packages[@]} -gt 0 ]; then
  echo "==> installing ${packages[*]}"
  apt-get update -qq
  # Keep the maintainer scripts from starting a system munge, slurmctld or slurmd.
  own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    own_policy=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
  [ "$own_policy" -eq 0 ] || rm -f /usr/sbin/policy-rc.d
fi

exec "$STEPWATCH_PY_VENV/bin/python" -m pytest -p no:cacheprovider -q deploy/slurm/test_slurm.py "$@"
