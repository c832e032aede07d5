#!/usr/bin/env bash
# The DRAM path by shard count, with --gpu off: for each count in SHARDS ("4 1"), 256-key
# batched lookups with one client and with one client per shard, three 8 s runs of 1 MiB gets
# (orbitkv-perf serve) and idle CPU (orbitkv-perf idle).
# Run from the repository root with the stripped release binaries in .device-bin/
# (git-ignored); results go to $OUT (an existing directory).
# SERVER picks another server binary (A/B runs), TAG names the outputs.
B=.device-bin
S=/tmp/okv/s.sock
SERVER=${SERVER:-$B/orbitkv-server}
TAG=${TAG:-}
mkdir -p /tmp/okv
for shards in ${SHARDS:-4 1}; do
$SERVER --socket $S --shards $shards --dram 8GiB --gpu off > $OUT/server$TAG$shards.log 2>&1 &
P=$!
for i in $(seq 150); do $B/orbitkv-ctl --socket $S health >/dev/null 2>&1 && break; sleep 0.2; done
$B/orbitkv-perf serve --socket $S --clients 1 --duration 5s --value-size 64KiB --working-set 64MiB --seed 3 --lookup-batch 256 --json > $OUT/lookup$TAG$shards.json 2>>$OUT/err.txt
$B/orbitkv-perf serve --socket $S --clients $shards --duration 5s --value-size 64KiB --working-set 64MiB --seed 4 --lookup-batch 256 --json > $OUT/lookup${TAG}${shards}x$shards.json 2>>$OUT/err.txt
for run in 1 2 3; do
$B/orbitkv-perf serve --socket $S --clients 1 --duration 8s --value-size 1MiB --working-set 2GiB --seed 1$run --json > $OUT/serve$TAG$shards-$run.json 2>>$OUT/err.txt
done
$B/orbitkv-perf idle --socket $S --duration 5s --json > $OUT/idle$TAG$shards.json 2>>$OUT/err.txt
$B/orbitkv-ctl --socket $S stats --json > $OUT/stats$TAG$shards.json 2>>$OUT/err.txt
kill -TERM $P; wait $P
done
