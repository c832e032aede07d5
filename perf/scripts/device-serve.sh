#!/usr/bin/env bash
# orbitkv-server with --gpu required (4 shards, 8 GiB) on a CUDA host, then DRAM gets with 1
# and 4 clients, batched lookups and idle CPU through it (orbitkv-perf serve, idle).
# Run from the repository root with the stripped release binaries in .device-bin/
# (git-ignored); results go to $OUT (an existing directory).
B=.device-bin
S=/tmp/okv/s.sock
mkdir -p /tmp/okv
{ nvidia-smi -L; nproc; free -g; ulimit -l; uname -r; } > $OUT/env.txt 2>&1
$B/orbitkv-server --socket $S --shards 4 --dram 8GiB --gpu required > $OUT/server.log 2>&1 &
P=$!
for i in $(seq 150); do $B/orbitkv-ctl --socket $S health >/dev/null 2>&1 && break; sleep 0.2; done
$B/orbitkv-ctl --socket $S stats --json > $OUT/stats.json 2>&1
$B/orbitkv-perf serve --socket $S --clients 1 --duration 10s --value-size 1MiB --working-set 2GiB --json > $OUT/serve1.json 2>>$OUT/env.txt
$B/orbitkv-perf serve --socket $S --clients 4 --duration 10s --value-size 1MiB --working-set 2GiB --seed 2 --json > $OUT/serve4.json 2>>$OUT/env.txt
$B/orbitkv-perf serve --socket $S --clients 1 --duration 5s --value-size 64KiB --working-set 64MiB --seed 3 --lookup-batch 256 --json > $OUT/lookup.json 2>>$OUT/env.txt
$B/orbitkv-perf idle --socket $S --duration 10s --json > $OUT/idle.json 2>>$OUT/env.txt
kill -TERM $P; wait $P; echo "server exit=$?" >> $OUT/server.log
