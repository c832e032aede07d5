#!/usr/bin/env bash
# Server builds or settings compared on one CUDA host beside the bf16 matmul loop, alternated
# A, B, A, B, ... (perf/scripts/device-gpu-server.sh with MPS=1 INTF=1 NOKILL=1 each time, so
# that all see the machine in the same states; AB_MPS=0 and AB_INTF=0 leave out MPS and the
# matmul, e.g. with ONLY="sglang-2k engine-copies-32k").
#
# Needs: run from the repository root; stripped release binaries in .device-bin/ (and
# .device-bin/orbitkv-server-prev for a second build); PyTorch with CUDA for the matmul;
# nvidia-cuda-mps-control for MPS; OUT, an existing directory for the results.
#
# SIDES ("A B") names the sides; each side X has a server binary X (A:
# .device-bin/orbitkv-server, others: .device-bin/orbitkv-server-prev), X_PTX optionally a
# checksum kernel PTX (ORBITKV_CHECKSUM_KERNEL_PTX, for a server built with `--features
# kernel-dev`), X_ENV optionally variables for its server process alone (e.g.
# "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=10"), X_ARGS optionally its own server arguments instead
# of SERVER_ARGS (one binary with two settings: A=.device-bin/orbitkv-server
# B=.device-bin/orbitkv-server B_ARGS="--gpu-job 128MiB"). ROUNDS (2) rounds; ONLY the runs
# ("intf-sglang-2k intf-nhd-32k"); SERVER_ARGS ("--gpu-staging 256MiB"); INTF_ROUNDS the
# interference runs' own rounds (see device-gpu-server.sh); RUN_TIMEOUT (150) bounds each run
# in seconds.
#
# Results go to $OUT with tags a1-, b1-, a2-, ... (the side's letter in lower case), the
# summary of all of them to $OUT/ab-summary.txt; the runs' files are then packed into
# $OUT/ab-runs.tgz (extract it for summarize-gpu.py), leaving the log, the summary and the
# archive. perf/scripts/ab-table.py ab-summary.txt [...] prints the runs as a markdown table,
# with each side's range.
set -u
B_DIR=.device-bin
SIDES=${SIDES:-"A B"}
A=${A:-$B_DIR/orbitkv-server}
for side in $SIDES; do
  [[ "$side" =~ ^[A-Z]$ ]] || { echo "SIDES: $side is not one capital letter" >&2; exit 2; }
  [ -n "${!side:-}" ] || printf -v "$side" '%s' "$B_DIR/orbitkv-server-prev"
done
ROUNDS=${ROUNDS:-2}
ONLY=${ONLY:-"intf-sglang-2k intf-nhd-32k"}
ARGS=${SERVER_ARGS:-"--gpu-staging 256MiB"}
for side in $SIDES; do
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
  for side in $SIDES; do
    tag=$(echo "$side" | tr '[:upper:]' '[:lower:]')$round-
    ptx_var=${side}_PTX
    env_var=${side}_ENV
    args_var=${side}_ARGS
    side_args=${!args_var:-$ARGS}
    echo "== $tag server ${!side} ${!ptx_var:+PTX ${!ptx_var}} ${!env_var:+env ${!env_var}} args $side_args" >> "$OUT/ab.log"
    (
      if [ -n "${!ptx_var:-}" ]; then export ORBITKV_CHECKSUM_KERNEL_PTX=${!ptx_var}; fi
      SERVER_ENV=${!env_var:-} SERVER=${!side} MPS=${AB_MPS:-1} INTF=${AB_INTF:-1} NOKILL=1 ONLY="$ONLY" SERVER_ARGS="$side_args" TAG=$tag \
        timeout "${RUN_TIMEOUT:-150}" bash perf/scripts/device-gpu-server.sh
    )
    echo "rc=$?" >> "$OUT/ab.log"
    leftovers
  done
done
python3 perf/scripts/summarize-gpu.py "$OUT" > "$OUT/ab-summary.txt" 2>&1
runs=$(cd "$OUT" && ls | grep -vxE 'ab\.log|ab-summary\.txt|ab-runs\.tgz')
if [ -n "$runs" ]; then
  # shellcheck disable=SC2086 # one name per word: the scripts' file names have no spaces
  tar czf "$OUT/ab-runs.tgz" -C "$OUT" $runs && (cd "$OUT" && rm -rf $runs)
fi
