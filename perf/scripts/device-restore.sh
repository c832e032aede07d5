#!/usr/bin/env bash
# Restore versus recompute, and decode steps beside saves, through orbitkv-server on a CUDA
# host (perf/scripts/device-restore.py). Needs PyTorch with CUDA and transformers, the orbitkv
# wheel importable (installed, or on PYTHONPATH), the stripped release server in .device-bin/,
# and OUT, an existing directory for the results. VARIANTS="name:server args ..." runs the
# decode-step measurement once per server configuration (commas in the args stand for spaces;
# name "mps" also starts an MPS daemon); TOKENS="" leaves out the restore runs;
# SAVER="--saver thread --saver-path engine" (say) is passed to every decode-step run.
# Results: $OUT/restore.json, $OUT/intf-NAME.json, logs.
B=.device-bin
S=/tmp/okvr/s.sock
serve() {
  pkill -x orbitkv-server; sleep 1; rm -rf /tmp/okvr; mkdir -p /tmp/okvr
  # shellcheck disable=SC2086 # server arguments are several words
  $B/orbitkv-server --socket $S --shards 4 --dram 16GiB --gpu required $1 >> $OUT/server.log 2>&1 &
  for _ in $(seq 200); do python3 -c "import orbitkv; orbitkv.Client('$S').ping()" 2>/dev/null && return; sleep 0.3; done
  echo "server did not start" >&2
}
if [ "${TOKENS-8192,32768}" != "" ]; then
  serve ""
  timeout 420 python3 perf/scripts/device-restore.py --socket $S --tokens "${TOKENS-8192,32768}" --out $OUT/restore.json
fi
for v in $VARIANTS; do
  name=${v%%:*}; args=${v#*:}; args=${args//,/ }
  (
    [ "$name" = mps ] && MPS=1 && . perf/scripts/mps.sh $OUT/mps.log
    serve "$args"
    echo "== $name: $args" >> $OUT/server.log
    # shellcheck disable=SC2086 # SAVER is several words
    timeout 200 python3 perf/scripts/device-restore.py --socket $S --tokens "" --out $OUT/intf-$name.json $SAVER
    pkill -x orbitkv-server; sleep 1
  )
done
