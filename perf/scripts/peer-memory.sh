#!/usr/bin/env bash
# Memory of cluster mode's per-chunk state, as RSS outside the arena: the requester's catalog
# per entry and the owner's view per chunk. Starts a private etcd and two Managers (a, b; one
# shard each) on this host, has `orbitkv-perf serve` put small chunks on a, waits for b's
# catalog to list them all, and prints each Manager's RSS outside its arena mapping before and
# after, per chunk. With CLUSTER=0 only a runs, standalone: its shard's own cost per chunk, to
# subtract from a's in cluster mode (what is left is the view and its change logs).
#
#   TE_LIBRARY=<libmooncake_transfer_engine.so> perf/scripts/peer-memory.sh
#
# BIN (target/release), WORKING_SET (1GiB; chunks of VALUE_SIZE, 4KiB, by default 262,144 keys
# of which `serve` puts most), DURATION (40s) of the put phase. Ports: etcd 23998-23999, peers
# 7701-7702.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release}
CLUSTER=${CLUSTER:-1}
DIR=$(mktemp -d /tmp/okv-peer-memory-XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT
# KiB of resident memory outside the process's largest mapping (the arena, populated whole).
outside_arena() {
  python3 - "$1" <<'PY'
import re, sys
maps, cur = [], None
for line in open(f"/proc/{sys.argv[1]}/smaps"):
    if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
        cur = {"Size": 0, "Rss": 0}
        maps.append(cur)
    else:
        m = re.match(r"^(Size|Rss):\s+(\d+) kB", line)
        if m:
            cur[m.group(1)] = int(m.group(2))
arena = max(maps, key=lambda m: m["Size"])
print(sum(m["Rss"] for m in maps) - arena["Rss"])
PY
}
nodes=(a)
if [ "$CLUSTER" = 1 ]; then
  : "${TE_LIBRARY:?TE_LIBRARY: a Transfer Engine C API library (or CLUSTER=0)}"
  nodes=(a b)
  etcd --name m --data-dir "$DIR/etcd" --listen-client-urls http://127.0.0.1:23999 \
    --advertise-client-urls http://127.0.0.1:23999 --listen-peer-urls http://127.0.0.1:23998 \
    --initial-advertise-peer-urls http://127.0.0.1:23998 --initial-cluster m=http://127.0.0.1:23998 \
    >"$DIR/etcd.log" 2>&1 &
  pids+=($!)
fi
declare -A pid
for node in "${nodes[@]}"; do
  args=()
  if [ "$CLUSTER" = 1 ]; then
    port=$([ "$node" = a ] && echo 7701 || echo 7702)
    args=(--etcd http://127.0.0.1:23999 --cluster memory --node-id "$node" --peer-addr "127.0.0.1:$port" --te-library "$TE_LIBRARY")
  fi
  "$BIN/orbitkv-server" --socket "$DIR/$node.sock" --no-lock-arena --shards 1 --dram 2GiB "${args[@]}" >"$DIR/$node.log" 2>&1 &
  pid[$node]=$!
  pids+=($!)
done
for node in "${nodes[@]}"; do
  for _ in $(seq 200); do "$BIN/orbitkv-ctl" --socket "$DIR/$node.sock" health >/dev/null 2>&1 && break; sleep 0.1; done
done
sleep 2
declare -A before
for node in "${nodes[@]}"; do before[$node]=$(outside_arena "${pid[$node]}"); done
"$BIN/orbitkv-perf" serve --socket "$DIR/a.sock" --value-size "${VALUE_SIZE:-4KiB}" \
  --working-set "${WORKING_SET:-1GiB}" --duration "${DURATION:-40s}" >"$DIR/serve.txt"
chunks=$("$BIN/orbitkv-ctl" --socket "$DIR/a.sock" stats --json |
  python3 -c "import json, sys; print(sum(s['entries'] for s in json.load(sys.stdin)['shards']))")
if [ "$CLUSTER" = 1 ]; then
  listed=0
  for _ in $(seq 300); do
    listed=$("$BIN/orbitkv-ctl" --socket "$DIR/b.sock" peers --json |
      python3 -c "import json, sys; print(json.load(sys.stdin)['peers'].get('a', {}).get('catalog_entries', 0))")
    [ "$listed" = "$chunks" ] && break
    sleep 0.2
  done
  [ "$listed" = "$chunks" ] || { echo "b's catalog lists $listed of a's $chunks chunks" >&2; exit 1; }
  sleep 5 # the view and catalog settled (the inventory streams drain every 50 ms)
fi
echo "chunks on a: $chunks$([ "$CLUSTER" = 1 ] && echo ", listed in b's catalog")"
for node in "${nodes[@]}"; do
  after=$(outside_arena "${pid[$node]}")
  python3 -c "b, a, n = ${before[$node]}, $after, $chunks; print(f'$node: {b} KiB before, {a} KiB after outside the arena: {(a - b) * 1024 / n:.0f} bytes per chunk')"
done
