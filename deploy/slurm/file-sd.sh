#!/usr/bin/env bash
# Prometheus file_sd targets for the agents of a Slurm cluster: every node whose GRES has a
# GPU, at the agent's port. Run it where `sinfo` works (e.g. from cron next to Prometheus),
# writing the file prometheus-file-sd.yml reads; Prometheus picks up changes by itself.
#
#   file-sd.sh [--port 19447] [--cluster NAME] > /etc/prometheus/file_sd/stepwatch.json
#
# The write is yours to make atomic (write a temporary file, then mv), so Prometheus never
# reads half a file.
set -euo pipefail
port=19447
cluster=""
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port="$2"; shift 2 ;;
    --cluster) cluster="$2"; shift 2 ;;
    *) echo "usage: $0 [--port N] [--cluster NAME]" >&2; exit 2 ;;
  esac
done
# %N the node, %G its GRES (e.g. "gpu:h100:8(S:0-1)"); one line per node and partition.
nodes=$(sinfo -N -h -o '%N %G' | awk '$2 ~ /(^|,)gpu[:(]/ { print $1 }' | sort -u)
printf '[{"targets": ['
sep=""
for node in $nodes; do
  printf '%s"%s:%s"' "$sep" "$node" "$port"
  sep=", "
done
printf ']'
[ -z "$cluster" ] || printf ', "labels": {"cluster": "%s"}' "$cluster"
printf '}]\n'
