#!/usr/bin/env bash
# Slurm prolog: records which GPUs the job holds on this node in the GPU<->job mapping
# directory of dcgm-exporter's --hpc-job-mapping-dir, which stepwatch reads with
# --slurm-job-mapping-dir. One prolog serves both tools; epilog.sh undoes it.
#
#   slurm.conf:  Prolog=/etc/slurm/prolog.d/*   (this file installed there, e.g. as 50-stepwatch.sh)
#                Epilog=/etc/slurm/epilog.d/*
#                PrologFlags=Alloc              (run at allocation, before any step)
#
# The directory holds one file per GPU, named by its index (SLURM_JOB_GPUS: the indices of
# gres.conf, which must follow NVML's order, as nvidia-smi numbers GPUs), one job id a line;
# a GPU shared by several jobs (sharding) has several lines. Files are replaced atomically
# under a lock, so readers never see half a file and concurrent prologs do not lose lines.
#
# slurmd runs it as root with SLURM_JOB_ID and SLURM_JOB_GPUS set. It never fails: a prolog's
# non-zero exit drains the node, so problems are only logged (stderr goes to slurmd's log).
# STEPWATCH_SLURM_JOB_MAPPING_DIR moves the directory (default /run/dcgm-job-map; slurmd does
# not pass its own environment on, so set it in a wrapper or edit the default here).
set -u
dir="${STEPWATCH_SLURM_JOB_MAPPING_DIR:-/run/dcgm-job-map}"
job="${SLURM_JOB_ID:-}"
gpus="${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}}"
umask 022

warn() { echo "stepwatch slurm prolog: $*" >&2; logger -t stepwatch-slurm -- "$*" 2>/dev/null || true; }

case "$job" in '' | *[!0-9]*) exit 0 ;; esac
[ -n "$gpus" ] || exit 0
mkdir -p "$dir" 2>/dev/null && chmod 0755 "$dir" 2>/dev/null || { warn "cannot create $dir"; exit 0; }
exec 9>"$dir/.lock" || { warn "cannot open $dir/.lock"; exit 0; }
flock -w 10 9 || { warn "no lock on $dir/.lock within 10 s; job $job is not mapped"; exit 0; }
for gpu in ${gpus//,/ }; do
  case "$gpu" in '' | *[!0-9]*) continue ;; esac # a UUID or MIG name is not a GPU index
  file="$dir/$gpu"
  tmp="$dir/.tmp-$gpu-$$"
  if { [ ! -f "$file" ] || grep -vx -- "$job" "$file" || true; } >"$tmp" \
    && echo "$job" >>"$tmp" && mv -f "$tmp" "$file"; then
    :
  else
    rm -f "$tmp"
    warn "cannot write $file for job $job"
  fi
done
exit 0
