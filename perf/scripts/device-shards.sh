#!/usr/bin/env bash
# Run from the repository root on the device machine, with the stripped release binaries in
# .device-bin (git-ignored, carried by the device tool); results go to $OUT.
B=.device-bin
S=/tmp/okv/s.sock
mkdir -p /tmp/okv
for shards in 4 1; do
$B/orbitkv-server --socket $S --shards $shards --dram 8GiB --gpu off > $OUT/server$shards.log 2>&1 &
P=$!
for i in $(seq 150); do $B/orbitkv-ctl --socket $S health >/dev/null 2>&1 && break; sleep 0.2; done
$B/orbitkv-perf serve --socket $S --clients 1 --duration 5s --value-size 64KiB --working-set 64MiB --seed 3 --lookup-batch 256 --json > $OUT/lookup$shards.json 2>>$OUT/err.txt
$B/orbitkv-perf serve --socket $S --clients $shards --duration 5s --value-size 64KiB --working-set 64MiB --seed 4 --lookup-batch 256 --json > $OUT/lookup${shards}x$shards.json 2>>$OUT/err.txt
for run in 1 2 3; do
$B/orbitkv-perf serve --socket $S --clients 1 --duration 8s --value-size 1MiB --working-set 2GiB --seed 1$run --json > $OUT/serve$shards-$run.json 2>>$OUT/err.txt
done
$B/orbitkv-perf idle --socket $S --duration 5s --json > $OUT/idle$shards.json 2>>$OUT/err.txt
$B/orbitkv-ctl --socket $S stats --json > $OUT/stats$shards.json 2>>$OUT/err.txt
kill -TERM $P; wait $P
done
