#!/usr/bin/env bash
# Two engine ranks of one tensor-parallel group (TP=2), one per GPU, through one orbitkv-server
# on a host with two CUDA GPUs. orbitkv-perf dma --socket acts as each rank:
# tensors shared by CUDA IPC, every byte checked both ways, the ranks meeting at a barrier so
# their ceilings, saves and loads run at the same time, the group prefix checked after both
# saved. Then one rank is SIGKILLed during a save while the other runs on, and a clean group
# run follows. SHARDS sets the shard count (15). DEVICES gives rank 0's and rank 1's GPU
# ("0 1"; "0 0" runs both ranks on one GPU: the correctness checks without the two-GPU rates).
# Run from the repository root with the stripped release binaries in .device-bin/; results go
# to $OUT (an existing directory).
B=.device-bin
read -r -a DEV <<< "${DEVICES:-0 1}"
[ ${#DEV[@]} -eq 2 ] || { echo "DEVICES: two GPU indices, rank 0's then rank 1's" >&2; exit 2; }
S=/tmp/okvtp/s.sock
rm -rf /tmp/okvtp; mkdir -p /tmp/okvtp
nvidia-smi topo -m > $OUT/topo.txt 2>&1
nvidia-smi --query-gpu=index,name,uuid,pci.bus_id --format=csv > $OUT/gpus.csv 2>&1
stats() { $B/orbitkv-ctl --socket $S stats --json; }
field() { python3 -c "import json,sys; d=json.load(sys.stdin); print(eval(sys.argv[1]))" "$1"; }
$B/orbitkv-server --socket $S --shards ${SHARDS:-15} --dram 24GiB --gpu required > $OUT/tp-server.log 2>&1 &
P=$!
for i in $(seq 300); do $B/orbitkv-ctl --socket $S health >/dev/null 2>&1 && break; sleep 0.2; done
D="$B/orbitkv-perf dma --socket $S --json"
NHD="--layout flash-nhd --layers 32 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 1024"
SGL="--layout sglang --layers 32 --block-tokens 1 --kv-heads 8 --head-dim 128 --blocks 16384 --blocks-per-chunk 16"
log() { echo "$*" >> $OUT/tp.log; }
# One rank alone on each GPU: each GPU's own ceiling and rate.
for dev in $(printf '%s\n' "${DEV[@]}" | sort -u); do
  log "== solo-nhd-$dev: --device $dev $NHD"
  $D --iterations 3 --device $dev $NHD > $OUT/tp-solo-nhd-$dev.json 2>> $OUT/tp.log; log "rc=$?"
done
# The group: both ranks at once.
group() {
  name=$1; shift
  rm -rf /tmp/okvtp/b-$name
  log "== group-$name: $*"
  for r in 0 1; do
    $D --iterations 3 --device ${DEV[$r]} --tp-rank $r --tp-world-size 2 --barrier /tmp/okvtp/b-$name "$@" \
      > $OUT/tp-$name-$r.json 2>> $OUT/tp.log &
    pids[$r]=$!
  done
  for r in 0 1; do wait ${pids[$r]}; log "rank $r rc=$?"; done
}
group nhd $NHD
group sglang $SGL
stats > $OUT/tp-stats-before-kill.json
# Rank 1 dies during a save; rank 0 must be unaffected. Rank 1 (8 GiB, 200 saves back to back:
# half a minute, so it is still saving when killed) starts first; rank 0 starts once rank 1 is
# registered, and rank 1 is killed 0.2 s after rank 0 registered too (rank 0 is then saving).
regs() { stats | field 'd["gpu_transfers"]["registrations"]' 2>/dev/null; }
log "== survivor: rank 0 on GPU ${DEV[0]} while rank 1 on GPU ${DEV[1]} is killed"
$D --iterations 200 --device ${DEV[1]} --tp-rank 1 --tp-world-size 2 --layout flash-nhd --layers 32 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 4096 --seed 6 > $OUT/tp-killed-1.json 2>&1 &
K=$!
for i in $(seq 600); do [ "$(regs)" -ge 1 ] 2>/dev/null && break; sleep 0.05; done
$D --iterations 8 --device ${DEV[0]} --tp-rank 0 --tp-world-size 2 $NHD --seed 5 > $OUT/tp-survivor-0.json 2>> $OUT/tp.log &
A=$!
for i in $(seq 600); do n=$(regs); [ "${n:-0}" -ge 2 ] 2>/dev/null && break; sleep 0.05; done
sleep 0.2
stats > $OUT/tp-stats-at-kill.json
kill -9 $K
stats > $OUT/tp-stats-just-after-kill.json; wait $K 2>/dev/null
log "killed rank 1 (registrations seen: $n)"
wait $A; log "survivor rc=$?"
for i in $(seq 200); do [ "$(stats | field 'd["sessions"]')" = "0" ] && break; sleep 0.05; done
stats > $OUT/tp-stats-after-kill.json
$B/orbitkv-ctl --socket $S health >> $OUT/tp.log 2>&1; log "health rc=$?"
group after-kill --layout flash-nhd --layers 8 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 512
stats > $OUT/tp-stats-end.json
kill -TERM $P; wait $P; log "server exit=$?"
