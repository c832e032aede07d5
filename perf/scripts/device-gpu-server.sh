#!/usr/bin/env bash
# GPU save/load through orbitkv-server on a CUDA host: orbitkv-perf dma --socket acts as the
# engine (tensors shared by CUDA IPC, every byte checked both ways), then an engine killed with
# SIGKILL in the middle of a save, then a clean run again. The sglang and flash-nhd runs also
# save half their chunks while loading the other half (--duplex).
#
# Needs: run from the repository root; stripped release binaries (orbitkv-server, orbitkv-perf,
# orbitkv-ctl) in .device-bin/; PyTorch with CUDA for the INTF runs; OUT, an existing directory
# for the results. perf/scripts/summarize-gpu.py DIR prints a line per result found in DIR.
#
# SHARDS sets the shard count (4); SERVER names another server binary (to compare builds on one
# machine); SERVER_ARGS adds server arguments, SERVER_ENV variables for the server process alone
# (e.g. CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=10). INTF=1 adds runs with --interference: a bf16
# matmul loop (PyTorch) beside the server's saves and loads, then beside the engine-side copies
# (about 60 s each; MPS=1 starts an MPS daemon for the server and the loop to share;
# INTF_ROUNDS=N repeats their measurements N times, --interference-rounds; INTF_ARGS adds perf
# arguments to those runs alone, e.g. "--engine-depth 8"). ONLY="name ..." keeps only those
# runs; NOKILL=1 leaves out the killed engine and the run after it (as
# perf/scripts/device-ab.sh does); TAG prefixes the output names.
B=.device-bin
S=/tmp/okvg/s.sock
. perf/scripts/mps.sh $OUT/gpu.log
mkdir -p /tmp/okvg
stats() { $B/orbitkv-ctl --socket $S stats --json; }
field() { python3 -c "import json,sys; d=json.load(sys.stdin); print(eval(sys.argv[1]))" "$1"; }
env $SERVER_ENV ${SERVER:-$B/orbitkv-server} --socket $S --shards ${SHARDS:-4} --dram 16GiB --gpu required $SERVER_ARGS > $OUT/${TAG}gpu-server.log 2>&1 &
P=$!
for i in $(seq 300); do $B/orbitkv-ctl --socket $S health >/dev/null 2>&1 && break; sleep 0.2; done
# Seven timed operations per direction (each between two windows of the ceiling; the ratio is
# their median): three left a run at the mercy of two slow operations on a noisy host.
D="$B/orbitkv-perf dma --socket $S --json --iterations 7"
run() { name=$1; shift; [ -n "$ONLY" ] && ! [[ " $ONLY " == *" $name "* ]] && return
  [[ " $* " == *" --interference "* ]] && [ -n "$INTF_ROUNDS" ] && set -- "$@" --interference-rounds "$INTF_ROUNDS"
  # shellcheck disable=SC2086 # INTF_ARGS is several words
  [[ " $* " == *" --interference "* ]] && [ -n "$INTF_ARGS" ] && set -- "$@" $INTF_ARGS
  echo "== $TAG$name: $*" >> $OUT/gpu.log; $D "$@" > $OUT/${TAG}gpu-$name.json 2>> $OUT/gpu.log; echo "rc=$?" >> $OUT/gpu.log; }
run sglang-2k --layout sglang --layers 32 --block-tokens 1 --kv-heads 8 --head-dim 128 --blocks 16384 --blocks-per-chunk 16 --duplex
run nhd-32k --layout flash-nhd --layers 32 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 1024 --duplex
run hnd-8k --layout flash-hnd --layers 32 --block-tokens 4 --kv-heads 8 --head-dim 128 --blocks 4096
# 3641 blocks of 576 KiB (32 layers): 2 GiB per operation, as the other runs (with 2048 blocks,
# 1.125 GiB, the fixed cost per request weighed almost twice as much).
run mla-18k --layout mla --layers 32 --block-tokens 16 --kv-heads 1 --head-dim 576 --blocks 3641
run nhd-128k --layout flash-nhd --layers 32 --block-tokens 64 --kv-heads 8 --head-dim 128 --blocks 256
run cross-32k --layout cross-layer --layers 32 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 1024
if [ "$INTF" = 1 ]; then
  run intf-sglang-2k --layout sglang --layers 32 --block-tokens 1 --kv-heads 8 --head-dim 128 --blocks 16384 --blocks-per-chunk 16 --interference
  run intf-nhd-32k --layout flash-nhd --layers 32 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 1024 --interference
  run intf-hnd-8k --layout flash-hnd --layers 32 --block-tokens 4 --kv-heads 8 --head-dim 128 --blocks 4096 --interference
  run intf-nhd-128k --layout flash-nhd --layers 32 --block-tokens 64 --kv-heads 8 --head-dim 128 --blocks 256 --interference
  # Whole 2 MiB chunks: the copies go batched (copy engines only), so its loads run no kernel
  # of the server's at all: the server's copy rate beside the matmul without its SM work.
  run intf-cross-32k --layout cross-layer --layers 32 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 1024 --interference
fi
# The engine-side path without CUDA IPC (the engine's own copies into its mapping of the arena).
run engine-copies-32k --layout flash-nhd --layers 32 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 1024 --seed 5 --engine-copies
stats > $OUT/${TAG}gpu-stats-before-kill.json
if [ "$NOKILL" != 1 ]; then
# An engine dies during a save: start a large run (8 GiB per save), kill it as soon as the
# server's save jobs move past where they stood (its first save is copying). The server's
# orphaned_requests (requests still running when their session closed) then say whether it
# died with a request in flight.
jobs0=$(stats | field 'd["gpu_transfers"]["save_jobs"]')
$D --layout flash-nhd --layers 32 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 4096 --seed 9 > $OUT/${TAG}gpu-killed.json 2>&1 &
K=$!
for i in $(seq 1000); do
  n=$(stats | field 'd["gpu_transfers"]["save_jobs"]' 2>/dev/null)
  [ "${n:-0}" -gt "${jobs0:-0}" ] && break; sleep 0.01
done
kill -9 $K; wait $K 2>/dev/null
echo "killed engine during save (server save jobs ${jobs0} before it, ${n} at the kill)" >> $OUT/gpu.log
for i in $(seq 200); do [ "$(stats | field 'd["sessions"]')" = "0" ] && break; sleep 0.05; done
stats > $OUT/${TAG}gpu-stats-after-kill.json
$B/orbitkv-ctl --socket $S health >> $OUT/gpu.log 2>&1; echo "health rc=$?" >> $OUT/gpu.log
run after-kill --layout flash-nhd --layers 8 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 512
fi
stats > $OUT/${TAG}gpu-stats-end.json
kill -TERM $P; wait $P; echo "server exit=$?" >> $OUT/gpu.log
