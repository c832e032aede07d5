#!/usr/bin/env python3
"""What a bf16 matmul loop loses to another process's kernels by their shape alone.

A question behind the server's checksummed saves beside an engine: does the engine lose in
proportion to the SM time of the server's kernels (blocks x duration), or to how long any of
them stays resident (one block folding for 80 us cost the matmul about as much as 256 blocks
summing rows for 40 us, docs/performance.md, "Which checksum kernel the matmul feels")? Here
a second process launches a kernel that only waits (its blocks spin on the global timer) of
GRID blocks of 256 threads for DUR microseconds, once per PERIOD microseconds, beside the
matmul loop of `orbitkv-perf dma --interference` (two 8192 x 8192 bf16 matrices, four
products per line); each shape's window is bracketed by windows of the matmul alone.

Run on the device machine under MPS (perf/scripts/device-residency.sh starts the daemon):
    python3 perf/scripts/device-residency.py OUT.json [GRID:DUR:PERIOD ...]
Needs PyTorch and CuPy (both on the device image). Prints a line per shape and writes JSON.
"""

import json
import subprocess
import sys
import time

WINDOW_S = 3.0

MATMUL = r"""
import sys, time, torch
torch.cuda.set_device(0)
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    c = a @ b
torch.cuda.synchronize()
print("ready", flush=True)
count = 0
while True:
    for _ in range(4):
        c = a @ b
    torch.cuda.current_stream().synchronize()
    count += 4
    print(f"{time.perf_counter():.6f} {count}", flush=True)
"""

SPINNER = r"""
import sys, time, cupy
grid, dur_us, period_us = (int(x) for x in sys.argv[1:4])
spin = cupy.RawKernel(r'''
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
''', "spin")
stream = cupy.cuda.Stream(non_blocking=True)
ns = cupy.uint64(dur_us * 1000)
with stream:
    spin((grid,), (256,), (ns,))
stream.synchronize()
print("ready", flush=True)
launches = 0
next_at = time.perf_counter()
while True:
    with stream:
        spin((grid,), (256,), (ns,))
    launches += 1
    next_at += period_us / 1e6
    # A late kernel (waiting for SMs) delays the next launch rather than queueing many.
    stream.synchronize()
    next_at = max(next_at, time.perf_counter())
    while time.perf_counter() < next_at:
        pass
    if launches % 200 == 0:
        print(f"{time.perf_counter():.6f} {launches}", flush=True)
"""


class Matmul:
    """The matmul loop in its own process; `rate(seconds)` is its products per second."""

    def __init__(self):
        self.p = subprocess.Popen(
            [sys.executable, "-c", MATMUL], stdout=subprocess.PIPE, text=True, bufsize=1
        )
        if self.p.stdout.readline().strip() != "ready":
            raise SystemExit("the matmul loop did not start")

    def rate(self, seconds):
        first = None
        while True:
            t, n = self.p.stdout.readline().split()
            t, n = float(t), int(n)
            if first is None:
                first = (t, n)
            elif t - first[0] >= seconds:
                return (n - first[1]) / (t - first[0])

    def stop(self):
        self.p.kill()


def spinner(grid, dur, period):
    p = subprocess.Popen(
        [sys.executable, "-c", SPINNER, str(grid), str(dur), str(period)],
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    if p.stdout.readline().strip() != "ready":
        raise SystemExit("the spinner did not start")
    return p


def main():
    out = sys.argv[1]
    shapes = [tuple(int(x) for x in s.split(":")) for s in sys.argv[2:]] or [
        (1, 80, 1200),  # the fold: one block, 80 us per 64 MiB job at 55 GB/s
        (256, 40, 1200),  # the row sums: 256 blocks, 40 us per job
        (1, 20, 1200),
        (1, 300, 1200),
        (132, 80, 1200),  # a block per SM, as long as the fold
        (1, 80, 2400),  # the fold of two jobs at once, every other job
        (1024, 30, 1200),  # a gather-like grid
    ]
    m = Matmul()
    try:
        m.rate(WINDOW_S)  # warm
        rows = []
        before = m.rate(WINDOW_S)
        for grid, dur, period in shapes:
            s = spinner(grid, dur, period)
            try:
                time.sleep(0.5)
                beside = m.rate(WINDOW_S)
            finally:
                s.kill()
                s.wait()
            time.sleep(0.5)
            after = m.rate(WINDOW_S)
            alone = (before + after) / 2
            row = {
                "grid": grid,
                "dur_us": dur,
                "period_us": period,
                "alone_per_s": alone,
                "alone_spread": abs(before - after) / alone,
                "beside_per_s": beside,
                "slowdown": 1 - beside / alone,
                "sm_time_share": grid * dur / period / 132,
                "resident_share": dur / period,
            }
            rows.append(row)
            print(
                f"grid {grid:5} x 256 for {dur:4} us every {period} us: slowdown "
                f"{100 * row['slowdown']:.2f}% (alone {before:.1f} / {after:.1f} per s; "
                f"resident {100 * row['resident_share']:.1f}% of the time, SM time "
                f"{100 * row['sm_time_share']:.2f}% of the GPU)",
                flush=True,
            )
            before = after
        json.dump({"rows": rows}, open(out, "w"), indent=1)
    finally:
        m.stop()


if __name__ == "__main__":
    main()
