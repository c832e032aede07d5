#!/usr/bin/env bash
# Runs perf/scripts/device-*.sh steps one after another on a CUDA host with their results
# packed into one archive (a full device-gpu-server.sh run alone writes dozens of files).
#   perf/scripts/device-pack.sh NAME 'VARS script.sh' ['VARS script.sh' ...]
# e.g. perf/scripts/device-pack.sh full 'SHARDS=4 SERVER_ARGS="--gpu-staging 256MiB" bash
#      perf/scripts/device-gpu-server.sh' 'ONLY=sglang-2k bash perf/scripts/device-dma.sh'
# Each step runs in its own folder (s1, s2, ...) with OUT pointing there, under `timeout`
# STEP_TIMEOUT seconds (default 540) so that the packing still happens; leftover servers and
# benchmark processes are stopped between steps. Leaves in $OUT (an existing directory):
# NAME.tgz (every step's files), NAME-summary.txt (perf/scripts/summarize-gpu.py of each step)
# and NAME.log. The steps need what each script needs (see their headers).
set -u
name=${1:?usage: device-pack.sh NAME 'VARS script.sh' ...}
shift
[[ "$name" =~ ^[A-Za-z0-9_-]+$ ]] || { echo "NAME: letters, digits, - and _ only" >&2; exit 2; }
[ $# -gt 0 ] || { echo "no step given" >&2; exit 2; }
work=$(mktemp -d /tmp/okv-pack.XXXXXX)
log=$OUT/$name.log
i=0
for step in "$@"; do
  i=$((i + 1))
  mkdir -p "$work/s$i"
  echo "== s$i: $step ($(date -u +%T))" >> "$log"
  OUT=$work/s$i timeout "${STEP_TIMEOUT:-540}" bash -c "$step" >> "$log" 2>&1
  echo "rc=$? ($(date -u +%T))" >> "$log"
  # By process name, exactly: a pattern over whole command lines would match this shell.
  pkill -x orbitkv-server
  pkill -x orbitkv-perf
  sleep 1
  rm -rf /tmp/okvg
  echo "== s$i: $step" >> "$OUT/$name-summary.txt"
  python3 perf/scripts/summarize-gpu.py "$work/s$i" >> "$OUT/$name-summary.txt" 2>&1
done
tar czf "$OUT/$name.tgz" -C "$work" . && rm -rf "$work"
