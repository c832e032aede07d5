#!/usr/bin/env bash
# The arena at host scale on a GPU host, in two parts (PART=start or PART=pages; each fits a
# 10-minute device call):
#   start: server starts by arena size (SIZES, "8GiB 16GiB 32GiB 64GiB") and shard count
#          (SHARDS, "1,2,4,8"), 4 KiB pages, --gpu off (the populate step alone), against one
#          thread memsetting the same bytes (orbitkv-perf arena); then one size
#          (CUDA_SIZE, 16GiB; CUDA_SHARDS, "1,8"), --gpu auto (the CUDA registration too,
#          each shard's slice registered by its own thread). ONE_MEMFD=1 adds the baseline of
#          the same bytes in one memfd populated at once (orbitkv-perf arena --one-memfd);
#          ARENA_MEMFDS=per-shard starts the servers with a memfd per shard; THP=1 runs
#          the starts with shared-memory THP (shmem_enabled advise, put back after), so the
#          arena's MADV_HUGEPAGE gets 2 MiB pages.
#   pages: starts on hugetlb pages (2 MiB reserved here: the host is root), and 1 MiB gets
#          against memcpy (orbitkv-perf serve --embedded) on 4 KiB, shared-memory THP and hugetlb
#          arenas; the reservation and THP setting are put back after.
# Run from the repository root with the stripped release binaries in .device-bin/
# (git-ignored); results go to $OUT (an existing directory; the device tool returns at most 8
# files, so point OUT at a scratch folder and tar it).
B=.device-bin
PART=${PART:-start}
{
  echo "nproc $(nproc)"; lscpu | grep -E 'Model name|NUMA|Socket'
  grep -E 'MemTotal|Huge' /proc/meminfo
  echo "shmem_enabled $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled)"
  echo "anon THP $(cat /sys/kernel/mm/transparent_hugepage/enabled)"
  echo "memlock $(ulimit -l)"; uname -r
} > "$OUT/host-$PART.txt" 2>&1

if [ "$PART" = start ]; then
  if [ -n "${THP:-}" ]; then
    old_shmem=$(sed -E 's/.*\[(.*)\].*/\1/' /sys/kernel/mm/transparent_hugepage/shmem_enabled)
    echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled
  fi
  for size in ${SIZES:-8GiB 16GiB 32GiB 64GiB}; do
    timeout 280 $B/orbitkv-perf arena --sizes "$size" --shards "${SHARDS:-1,2,4,8}" --json ${ONE_MEMFD:+--one-memfd} \
      --arena-memfds "${ARENA_MEMFDS:-one}" \
      > "$OUT/arena-$size.json" 2>> "$OUT/err.txt"
    echo "arena $size exit $?" >> "$OUT/err.txt"
  done
  timeout 200 $B/orbitkv-perf arena --sizes "${CUDA_SIZE:-16GiB}" --shards "${CUDA_SHARDS:-1,8}" --gpu auto --json \
    --arena-memfds "${ARENA_MEMFDS:-one}" \
    > "$OUT/arena-cuda.json" 2>> "$OUT/err.txt"
  echo "arena cuda exit $?" >> "$OUT/err.txt"
  [ -n "${THP:-}" ] && echo "$old_shmem" > /sys/kernel/mm/transparent_hugepage/shmem_enabled
fi

if [ "$PART" = pages ]; then
  size=${PAGES_SIZE:-16GiB}
  gib=$(( ${size%GiB} ))
  serve() {  # tag, then flags for the server
    local tag=$1; shift
    local args=()
    for a in "$@"; do args+=("--embedded-server-arg=$a"); done
    for seed in 1 2 3; do
      timeout 60 $B/orbitkv-perf serve --embedded --embedded-dram 8GiB --embedded-shards 1 \
        "${args[@]}" --clients 1 --duration 8s --value-size 1MiB --working-set 4GiB \
        --baseline-every 1s --seed $seed --json > "$OUT/serve-$tag-$seed.json" 2>> "$OUT/err.txt"
    done
  }
  serve 4k --hugepages off
  old_shmem=$(sed -E 's/.*\[(.*)\].*/\1/' /sys/kernel/mm/transparent_hugepage/shmem_enabled)
  echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled
  # Newer kernels also have a shmem setting per THP size; "inherit" follows the one above.
  cat /sys/kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled >> "$OUT/host-pages.txt" 2>&1
  # The shared memory on huge pages while the gets run (the arena is unmapped after).
  ( while sleep 2; do grep -E 'ShmemHugePages|ShmemPmdMapped' /proc/meminfo | tr '\n' ' '; echo; done ) \
    > "$OUT/thp-meminfo.txt" &
  sampler=$!
  serve thp --hugepages off
  kill $sampler
  echo "$old_shmem" > /sys/kernel/mm/transparent_hugepage/shmem_enabled
  old_pages=$(cat /proc/sys/vm/nr_hugepages)
  # One more page than the arena needs for its header; the gets' server takes 8 GiB.
  echo $(( gib * 512 + 8 )) > /proc/sys/vm/nr_hugepages
  grep -E 'HugePages_(Total|Free)' /proc/meminfo >> "$OUT/host-pages.txt"
  serve hugetlb --hugepages on
  timeout 200 $B/orbitkv-perf arena --sizes "$size" --shards 1,8 --hugepages on --json \
    > "$OUT/arena-hugetlb.json" 2>> "$OUT/err.txt"
  echo "arena hugetlb exit $?" >> "$OUT/err.txt"
  echo "$old_pages" > /proc/sys/vm/nr_hugepages
fi
