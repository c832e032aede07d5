#!/usr/bin/env python3
"""How long a gather kernel from another process waits for SMs beside a bf16 matmul loop, and
whether a kernel already resident (a standby gather that polls for work) answers sooner.

Beside the matmul loop under MPS, a server save's first copy started 0.7-0.8 ms into the save
whatever the first gather's size or block size (docs/performance.md, eighteenth session):
about half of one 8192 x 8192 product, as if a newly launched grid got SMs only once the
running product had handed out its last blocks. Here, in a process of their own beside the
matmul loop of `orbitkv-perf dma --interference`:

- `launch`: every PERIOD microseconds a copy of BYTES (device to device, GRID blocks of 256
  threads, 16 bytes a thread a step) is launched and waited for: the host's wait and the
  GPU's (events around the launch: the wait for SMs plus the copy).
- `standby`: one kernel of GRID blocks is launched once and stays resident, polling a word
  in mapped host memory; every PERIOD microseconds the host bumps the word and waits for the
  kernel to write back that it copied BYTES: the host's wait, and the copy on the GPU's clock.
- `standby-idle`: the same kernel resident, never given work: what residency alone costs.

Each case runs first without the matmul, then beside it, its matmul window bracketed by
windows of the matmul alone (as device-residency.py, whose loop this uses). Run on the device
machine under MPS (perf/scripts/device-standby.sh starts the daemon):
    python3 perf/scripts/device-standby.py OUT.json [MODE:MIB:GRID:PERIOD_US ...]
Needs PyTorch and CuPy (both on the device image). Prints a line per case and writes JSON.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time

_spec = importlib.util.spec_from_file_location(
    "residency", os.path.join(os.path.dirname(os.path.abspath(__file__)), "device-residency.py")
)
residency = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(residency)

WINDOW_S = residency.WINDOW_S

WORKLOAD = r"""
import json, random, sys, time
import cupy, numpy
mode, mib, grid, period_us, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
SRC = r'''
extern "C" __global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                  unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}

__device__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ctrl, in mapped host memory: [0] work number (host), [1] work number done (kernel),
// [2] quit (host), [3] all blocks resident (kernel). `count` in device memory: [0] blocks
// arrived, [1] blocks done with the current work. stamps[2 w], [2 w + 1]: when block 0 saw
// work w and when its last block finished it (global timer, ns).
extern "C" __global__ void standby(volatile unsigned int* ctrl, unsigned int* count,
                                   const uint4* __restrict__ src, uint4* __restrict__ dst,
                                   unsigned long long n, unsigned long long* stamps,
                                   unsigned int work) {
    __shared__ unsigned int go;
    if (threadIdx.x == 0 && atomicAdd(&count[0], 1u) == gridDim.x - 1) {
        ctrl[3] = 1;
        __threadfence_system();
    }
    unsigned int seen = 0;
    while (true) {
        if (threadIdx.x == 0) {
            unsigned int g = ctrl[0];
            while (g == seen && ctrl[2] == 0) {
                __nanosleep(500);
                g = ctrl[0];
            }
            go = ctrl[2] != 0 ? 0xffffffffu : g;
            if (blockIdx.x == 0 && go != 0xffffffffu) {
                stamps[2 * (g % 65536u)] = now_ns();
            }
        }
        __syncthreads();
        const unsigned int g = go;
        if (g == 0xffffffffu) {
            return;
        }
        seen = g;
        if (work) {
            for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
                 i < n; i += (unsigned long long)gridDim.x * blockDim.x) {
                dst[i] = src[i];
            }
        }
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0 && atomicAdd(&count[1], 1u) == gridDim.x - 1) {
            count[1] = 0;
            stamps[2 * (g % 65536u) + 1] = now_ns();
            __threadfence_system();
            ctrl[1] = g;
            __threadfence_system();
        }
    }
}
'''
mod = cupy.RawModule(code=SRC, options=("-std=c++14",))
copy16, standby = mod.get_function("copy16"), mod.get_function("standby")
n16 = mib * (1 << 20) // 16
src = cupy.random.randint(0, 2**31, size=n16 * 4, dtype=cupy.int32)
dst = cupy.empty_like(src)
stream = cupy.cuda.Stream(non_blocking=True)
host, gpu = [], []
failed = 0
if mode == "launch":
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    with stream:
        copy16((grid,), (256,), (src, dst, numpy.uint64(n16)))
    stream.synchronize()
    print("ready", flush=True)
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        time.sleep(random.uniform(0.5, 1.5) * period_us / 1e6)
        t = time.perf_counter()
        with stream:
            start.record(stream)
            copy16((grid,), (256,), (src, dst, numpy.uint64(n16)))
            end.record(stream)
        end.synchronize()
        host.append((time.perf_counter() - t) * 1e6)
        gpu.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
else:
    mem = cupy.cuda.alloc_pinned_memory(64)
    ctrl = numpy.ndarray((16,), dtype=numpy.uint32, buffer=mem)
    ctrl[:] = 0
    count = cupy.zeros(2, dtype=cupy.uint32)
    stamps = cupy.zeros(2 * 65536, dtype=cupy.uint64)
    args = (numpy.uint64(mem.ptr), count, src, dst, numpy.uint64(n16), stamps,
            numpy.uint32(mode == "standby"))
    with stream:
        standby((grid,), (256,), args)
    t = time.perf_counter()
    while ctrl[3] == 0 and time.perf_counter() - t < 10:
        pass
    if ctrl[3] == 0:
        ctrl[2] = 1
        print(json.dumps({"error": "the standby kernel was not resident within 10 s"}), flush=True)
        stream.synchronize()
        sys.exit(0)
    print("ready", flush=True)
    until = time.perf_counter() + seconds
    w = 0
    try:
        while time.perf_counter() < until:
            if mode == "standby-idle":
                time.sleep(0.01)
                continue
            time.sleep(random.uniform(0.5, 1.5) * period_us / 1e6)
            w += 1
            t = time.perf_counter()
            ctrl[0] = w
            while ctrl[1] != w and time.perf_counter() - t < 1:
                pass
            if ctrl[1] != w:
                failed += 1
                break
            host.append((time.perf_counter() - t) * 1e6)
    finally:
        # The kernel polls until told to quit: tell it, whatever happened here.
        ctrl[2] = 1
    stream.synchronize()
    s = stamps.get().reshape(-1, 2)
    gpu = [float(s[i][1] - s[i][0]) / 1e3 for i in range(1, w + 1) if s[i][1] >= s[i][0] > 0]
def stat(v):
    if not v:
        return None
    v = sorted(v)
    return {"n": len(v), "median": v[len(v) // 2], "p90": v[int(len(v) * 0.9)],
            "mean": sum(v) / len(v), "max": v[-1]}
print(json.dumps({"host_us": stat(host), "gpu_us": stat(gpu), "failed": failed}), flush=True)
"""


def workload(mode, mib, grid, period_us, seconds):
    p = subprocess.Popen(
        [sys.executable, "-c", WORKLOAD, mode, str(mib), str(grid), str(period_us), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    first = p.stdout.readline().strip()
    if first != "ready":
        p.wait()
        return None, json.loads(first) if first.startswith("{") else {"error": first or "no output"}
    return p, None


def finish(p):
    out = p.stdout.readline().strip()
    p.wait()
    return json.loads(out) if out.startswith("{") else {"error": out or "no output"}


def show(label, r):
    def f(s):
        if not s:
            return "-"
        return f"median {s['median']:.0f} us, p90 {s['p90']:.0f}, mean {s['mean']:.0f}"

    if "error" in r:
        return f"{label}: {r['error']}"
    return f"{label}: host {f(r.get('host_us'))}; GPU {f(r.get('gpu_us'))}; failed {r['failed']}"


def main():
    out = sys.argv[1]
    cases = [tuple(s.split(":")) for s in sys.argv[2:]] or [
        ("launch", "0", "1", "2000"),  # one block, no work: the wait for an SM alone
        ("launch", "4", "1024", "2000"),
        ("launch", "64", "1024", "4000"),
        ("standby-idle", "64", "132", "0"),
        ("standby", "4", "132", "2000"),
        ("standby", "64", "132", "4000"),
        ("standby", "64", "264", "4000"),
    ]
    cases = [(m, int(a), int(g), int(p)) for m, a, g, p in cases]
    rows = []
    # Without the matmul first.
    for mode, mib, grid, period in cases:
        p, err = workload(mode, mib, grid, period, WINDOW_S)
        r = err if p is None else finish(p)
        rows.append({"mode": mode, "mib": mib, "grid": grid, "period_us": period, "alone": r})
        print(show(f"{mode} {mib} MiB grid {grid} every {period} us, alone", r), flush=True)
    m = residency.Matmul()
    try:
        m.rate(WINDOW_S)  # warm
        before = m.rate(WINDOW_S)
        for row in rows:
            p, err = workload(row["mode"], row["mib"], row["grid"], row["period_us"], WINDOW_S + 1)
            if p is None:
                row["beside"] = err
                print(show("  beside the matmul", err), flush=True)
                continue
            try:
                time.sleep(0.3)
                beside = m.rate(WINDOW_S)
            finally:
                r = finish(p)
            time.sleep(0.5)
            after = m.rate(WINDOW_S)
            alone = (before + after) / 2
            row["beside"] = r
            row["matmul"] = {
                "alone_per_s": alone,
                "alone_spread": abs(before - after) / alone,
                "beside_per_s": beside,
                "slowdown": 1 - beside / alone,
            }
            print(
                show("  beside the matmul", r)
                + f"; matmul slowdown {100 * row['matmul']['slowdown']:.2f}% "
                f"(alone {before:.1f} / {after:.1f} per s)",
                flush=True,
            )
            before = after
    finally:
        m.stop()
    json.dump({"rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
