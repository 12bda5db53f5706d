#!/usr/bin/env bash
# Slurm epilog: removes the job from the GPU<->job mapping directory that prolog.sh fills
# (dcgm-exporter's --hpc-job-mapping-dir, stepwatch's --slurm-job-mapping-dir); a GPU's file
# goes once no job is left on it. It looks at every GPU's file, not at SLURM_JOB_GPUS, so a
# job is removed even where the prolog saw other GPUs. Never fails (a failing epilog drains
# the node); STEPWATCH_SLURM_JOB_MAPPING_DIR as for prolog.sh.
set -u
dir="${STEPWATCH_SLURM_JOB_MAPPING_DIR:-/run/dcgm-job-map}"
job="${SLURM_JOB_ID:-}"
umask 022

warn() { echo "stepwatch slurm epilog: $*" >&2; logger -t stepwatch-slurm -- "$*" 2>/dev/null || true; }

case "$job" in '' | *[!0-9]*) exit 0 ;; esac
[ -d "$dir" ] || exit 0
exec 9>"$dir/.lock" || { warn "cannot open $dir/.lock"; exit 0; }
flock -w 10 9 || { warn "no lock on $dir/.lock within 10 s; job $job stays mapped"; exit 0; }
for file in "$dir"/*; do
  name="${file##*/}"
  case "$name" in '' | *[!0-9.]*) continue ;; esac # GPU indices and <gpu>.<instance> only
  [ -f "$file" ] && grep -qx -- "$job" "$file" || continue
  tmp="$dir/.tmp-$name-$$"
  if grep -vx -- "$job" "$file" >"$tmp"; then
    mv -f "$tmp" "$file" || warn "cannot rewrite $file"
  else
    # No job left on this GPU (or grep failed): the file goes.
    rm -f "$tmp" "$file" || warn "cannot remove $file"
  fi
done
exit 0
