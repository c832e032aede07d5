#!/usr/bin/env bash
# GPU save/load without a server (orbitkv-perf dma) against the contiguous ceiling at 2, 8, 32
# and 128 KiB pages and in every layout, about 2 GiB per operation. Run from the repository
# root on a CUDA host with the stripped release binaries in .device-bin/; results go to $OUT
# (an existing directory). The --interference runs need PyTorch with CUDA.
# EXTRA: arguments passed to every run; TAG prefixes the output names; ONLY="a b" limits the
# runs to those names.
# MPS=1 runs everything under a CUDA MPS daemon started here (and stopped at the end), so the
# copy kernels and the matmul loop of --interference share the GPU instead of time-slicing.
# PERF names another orbitkv-perf binary (to compare builds on one machine). INTF_ROUNDS=N
# repeats the --interference runs' measurements N times (--interference-rounds).
# perf/scripts/summarize-gpu.py DIR prints a line per result found in DIR.
B=.device-bin
. perf/scripts/mps.sh $OUT/dma.log
P="${PERF:-$B/orbitkv-perf} dma --json --iterations 5"
run() {
  name=$1; shift
  if [ -n "$ONLY" ] && ! [[ " $ONLY " == *" $name "* ]]; then return; fi
  if [[ " $* " == *" --interference "* ]] && [ -n "$INTF_ROUNDS" ]; then
    set -- "$@" --interference-rounds "$INTF_ROUNDS"
  fi
  echo "== $TAG$name: $* $EXTRA" >> $OUT/dma.log
  $P "$@" $EXTRA > $OUT/dma-$TAG$name.json 2>> $OUT/dma.log
  echo "rc=$?" >> $OUT/dma.log
}
# page = block_tokens x kv_heads x head_dim x 2 bytes (bf16)
run sglang-2k   --layout sglang    --layers 32 --block-tokens 1  --kv-heads 8 --head-dim 128 --blocks 16384 --blocks-per-chunk 16
run nhd-8k      --layout flash-nhd --layers 32 --block-tokens 4  --kv-heads 8 --head-dim 128 --blocks 4096
# The same pages in 2 MiB chunks (four blocks per chunk): each chunk's arena slot is one
# host-side run, and runs under a megabyte cost the device-to-host copy a few percent.
run nhd-8k-c4   --layout flash-nhd --layers 32 --block-tokens 4  --kv-heads 8 --head-dim 128 --blocks 4096 --blocks-per-chunk 4
# The same 512 KiB chunks in adjacent slots (as the server orders a job): host copies merge.
run nhd-8k-seq  --layout flash-nhd --layers 32 --block-tokens 4  --kv-heads 8 --head-dim 128 --blocks 4096 --slots in-order
run nhd-32k     --layout flash-nhd --layers 32 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 1024
run nhd-128k    --layout flash-nhd --layers 32 --block-tokens 64 --kv-heads 8 --head-dim 128 --blocks 256
run hnd-32k     --layout flash-hnd --layers 32 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 1024
run cross-32k   --layout cross-layer --layers 32 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 1024
# 3641 blocks of 576 KiB (32 layers): 2 GiB per operation, as the other runs.
run mla-18k     --layout mla       --layers 32 --block-tokens 16 --kv-heads 1 --head-dim 576 --blocks 3641
run nhd-fp8-16k --layout flash-nhd --layers 32 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 2048 --dtype fp8
# The slowdown of a concurrent bf16 matmul loop (PyTorch) beside the contiguous copy and each strategy.
run intf-sglang-2k --layout sglang --layers 32 --block-tokens 1 --kv-heads 8 --head-dim 128 --blocks 16384 --blocks-per-chunk 16 --strategy all --interference
run intf-nhd-32k --layout flash-nhd --layers 32 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 1024 --strategy all --interference
# The same with a smaller staging (64 MiB in two parts, the server's default before 256 MiB):
# more, shorter kernel launches per byte, so more context switches between our kernels and
# the engine's (time-slicing without MPS).
run intf-sglang-2k-s64 --layout sglang --layers 32 --block-tokens 1 --kv-heads 8 --head-dim 128 --blocks 16384 --blocks-per-chunk 16 --strategy auto --staging 64MiB --interference
run intf-nhd-32k-s64 --layout flash-nhd --layers 32 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 1024 --strategy auto --staging 64MiB --interference
# The engine-side copies with larger staging batches: their loads' scatter waits for SMs behind
# the matmul, and fewer, larger batches trade rate against the matmul's slowdown.
run intf-sglang-2k-e4 --layout sglang --layers 32 --block-tokens 1 --kv-heads 8 --head-dim 128 --blocks 16384 --blocks-per-chunk 16 --strategy auto --interference
run intf-sglang-2k-e64 --layout sglang --layers 32 --block-tokens 1 --kv-heads 8 --head-dim 128 --blocks 16384 --blocks-per-chunk 16 --strategy auto --interference --engine-batch 64MiB
run intf-sglang-2k-e8 --layout sglang --layers 32 --block-tokens 1 --kv-heads 8 --head-dim 128 --blocks 16384 --blocks-per-chunk 16 --strategy auto --interference --engine-depth 8
# The engine-side copies at 32 KiB pages (the default 4 x 32 MiB batches in flight).
run intf-nhd-32k-e4 --layout flash-nhd --layers 32 --block-tokens 16 --kv-heads 8 --head-dim 128 --blocks 1024 --strategy auto --interference
