#!/usr/bin/env bash
# Two server builds compared beside the bf16 matmul on the device machine, alternated A, B, A,
# B, ... (perf/scripts/device-gpu-server.sh with MPS=1 INTF=1 NOKILL=1 each time, so that both
# see the machine in the same states). A and B name the server binaries (default: the one in
# .device-bin, and .device-bin/orbitkv-server-prev); A_PTX / B_PTX optionally name a checksum
# kernel PTX for that side (ORBITKV_CHECKSUM_KERNEL_PTX). ROUNDS (2) rounds; ONLY the runs
# ("intf-sglang-2k intf-nhd-32k"); SERVER_ARGS ("--gpu-staging 256MiB"). Results go to $OUT
# with tags a1-, b1-, a2-, ...; the summary of all of them to $OUT/ab-summary.txt.
set -u
B_DIR=.device-bin
A=${A:-$B_DIR/orbitkv-server}
B=${B:-$B_DIR/orbitkv-server-prev}
ROUNDS=${ROUNDS:-2}
ONLY=${ONLY:-"intf-sglang-2k intf-nhd-32k"}
ARGS=${SERVER_ARGS:-"--gpu-staging 256MiB"}
for side in A B; do
  bin=${!side}
  [ -x "$bin" ] || { echo "$side: $bin is not an executable server binary" >&2; exit 2; }
done
# Whatever a run left behind. By process name, exactly: a pattern over whole command lines
# would also match the shell running this script.
leftovers() {
  pkill -x orbitkv-server
  pkill -x orbitkv-perf
  sleep 1
  # The MPS daemon of perf/scripts/mps.sh, if its run's own exit did not stop it.
  if [ -d /tmp/okv-mps/pipe ]; then
    echo quit | CUDA_MPS_PIPE_DIRECTORY=/tmp/okv-mps/pipe nvidia-cuda-mps-control 2>/dev/null
  fi
  rm -rf /tmp/okvg
}
for round in $(seq "$ROUNDS"); do
  for side in A B; do
    tag=$(echo "$side" | tr AB ab)$round-
    ptx_var=${side}_PTX
    echo "== $tag server ${!side} ${!ptx_var:+PTX ${!ptx_var}}" >> "$OUT/ab.log"
    (
      if [ -n "${!ptx_var:-}" ]; then export ORBITKV_CHECKSUM_KERNEL_PTX=${!ptx_var}; fi
      SERVER=${!side} MPS=1 INTF=1 NOKILL=1 ONLY="$ONLY" SERVER_ARGS="$ARGS" TAG=$tag \
        timeout 150 bash perf/scripts/device-gpu-server.sh
    )
    echo "rc=$?" >> "$OUT/ab.log"
    leftovers
  done
done
python3 perf/scripts/summarize-gpu.py "$OUT" > "$OUT/ab-summary.txt" 2>&1
