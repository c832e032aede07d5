#!/usr/bin/env bash
# Two Managers of one cluster on this host (a private etcd, loopback peer addresses) and
# `orbitkv-perf peer` between them; extra arguments go to `orbitkv-perf peer`.
#
#   TE_VENV=target/venvs/te-0.3.13.post1 perf/scripts/peer-loopback.sh --chunks 512
#
# Needs etcd on PATH and a Transfer Engine: TE_LIBRARY naming a TE build's C API library
# (given to both Managers and to the baseline as --te-library; any release build), or release
# builds with the wheel's engine:
#   PYO3_PYTHON=$TE_VENV/bin/python cargo build --release -p orbitkv-server -p orbitkv-perf \
#     --features orbitkv-server/te-python,orbitkv-perf/te-python
# SHARDS (default 1) and DRAM (default 2GiB) size each Manager; SERVER_ARGS adds flags to both.
# CPUS_A / CPUS_B / CPUS_BENCH (taskset lists, e.g. 0-3) keep the two Managers and the
# benchmark (with etcd) on cores of their own: each Manager pins its shards to the first cores
# it may use, so two on one host without them share those cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
TE_VENV=${TE_VENV:-target/venvs/te-0.3.13.post1}
BIN=${BIN:-target/release}
SHARDS=${SHARDS:-1}
DRAM=${DRAM:-2GiB}
TE_ARGS=()
if [ -n "${TE_LIBRARY:-}" ]; then
  # TE_TRANSPORT (auto or tcp, default auto): the engines' --te-transport.
  TE_ARGS=(--te-library "$TE_LIBRARY" --te-transport "${TE_TRANSPORT:-auto}")
else
  # TE_SITE: a directory the wheel was installed into (`pip install --target`), not a venv.
  PYTHONPATH=${TE_SITE:-$("$TE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')}
  export PYTHONPATH
fi
DIR=$(mktemp -d /tmp/okv-peer-XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  # LOGS_OUT: a directory to keep the Managers' and etcd's logs in.
  if [ -n "${LOGS_OUT:-}" ]; then mkdir -p "$LOGS_OUT" && cp "$DIR"/*.log "$LOGS_OUT"/; fi
  rm -rf "$DIR"
}
trap cleanup EXIT
on() { if [ -n "$1" ]; then echo "taskset -c $1"; fi; }
$(on "${CPUS_BENCH:-}") etcd --name p --data-dir "$DIR/etcd" --listen-client-urls http://127.0.0.1:23791 \
  --advertise-client-urls http://127.0.0.1:23791 --listen-peer-urls http://127.0.0.1:23801 \
  --initial-advertise-peer-urls http://127.0.0.1:23801 --initial-cluster p=http://127.0.0.1:23801 \
  >"$DIR/etcd.log" 2>&1 &
pids+=($!)
for node in a b; do
  port=$([ "$node" = a ] && echo 7601 || echo 7602)
  cpus=$([ "$node" = a ] && echo "${CPUS_A:-}" || echo "${CPUS_B:-}")
  $(on "$cpus") "$BIN/orbitkv-server" --socket "$DIR/$node.sock" --no-lock-arena --shards "$SHARDS" --dram "$DRAM" \
    ${SERVER_ARGS:-} --etcd http://127.0.0.1:23791 --cluster perf --node-id "$node" --peer-addr "127.0.0.1:$port" \
    "${TE_ARGS[@]}" >"$DIR/$node.log" 2>&1 &
  pids+=($!)
done
for node in a b; do
  for _ in $(seq 200); do
    [ -S "$DIR/$node.sock" ] && break
    sleep 0.05
  done
done
sleep 1 # the inventory streams start on the members' next read of etcd
$(on "${CPUS_BENCH:-}") "$BIN/orbitkv-perf" peer --owner "$DIR/a.sock" --requester "$DIR/b.sock" "${TE_ARGS[@]}" "$@"
# PEERS_OUT: where to write the requester's `orbitkv-ctl peers --json` after the run.
if [ -n "${PEERS_OUT:-}" ]; then
  "$BIN/orbitkv-ctl" --socket "$DIR/b.sock" peers --json >"$PEERS_OUT" || true
fi
