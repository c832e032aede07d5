#!/usr/bin/env python3
"""How fast device-to-host copies run beside a bf16 matmul loop, by how they are issued.

The question behind the server's saves beside an engine (docs/performance.md): alone the
server's 64 MiB staging copies run at the contiguous copy's rate (55.1 GB/s on the H200),
beside the matmul under MPS at 53.0 while the contiguous copy there keeps 55.2. Is it the
copies' size, their wait on a gather kernel's event, or kernels reading memory beside them?
This process copies 2 GiB per round from device memory to pinned host memory, shaped as:

  one        one 2 GiB copy
  split      32 copies of 64 MiB back to back on one stream
  split+read split, and a kernel reading each copy's source part (a sum) beside it on another
             stream, as a cross-layer save's checksum kernels read its bytes (no gather)
  split+write split, and a gather (index_select) writing staging beside each copy, the copies
             not waiting for it: the gather's memory traffic without the dependency
  split+wait split, each copy waiting on an event recorded after a one-element kernel on
             another stream (all queued first): the dependency without the traffic
  piped      each 64 MiB part gathered first (index_select of 2 KiB pages, an SM kernel) into
             one of four staging parts, the copy waiting on the gather's event (the server's
             staging pipeline at depth 4)
  piped+read piped, and a kernel reading each gathered part (a sum) beside its copy, as the
             checksum kernels read a save's bytes

alone, then beside the matmul loop of `orbitkv-perf dma --interference` (two 8192 x 8192 bf16
matrices, four products per line) in another process, each window bracketed by windows of the
matmul alone. Copy rates come from CUDA events around each copy ("while copying") and from the
first copy's start to the last one's end ("overall").

Run on the device machine under MPS (perf/scripts/device-copyrate.sh starts the daemon):
    python3 perf/scripts/device-copyrate.py OUT.json [SHAPE ...]
Needs PyTorch (on the device image). Prints a line per window and writes JSON.
"""

import importlib.util
import json
import os
import sys
import time
from threading import Thread

import torch

# The matmul loop and its windows, as device-residency.py runs them.
_spec = importlib.util.spec_from_file_location(
    "residency", os.path.join(os.path.dirname(os.path.abspath(__file__)), "device-residency.py")
)
residency = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(residency)

WINDOW_S = residency.WINDOW_S
PART = 64 << 20
PARTS = 32  # per round: 2 GiB
DEPTH = 4
PAGE = 2048


class Copier:
    """2 GiB rounds of device-to-host copies in one of the shapes above."""

    def __init__(self):
        words = PAGE // 8
        pages = PART * PARTS // PAGE
        self.pool = torch.randint(0, 1 << 62, (pages, words), device="cuda", dtype=torch.int64)
        self.flat = self.pool.view(-1).view(torch.uint8)
        self.host = torch.empty(PART * PARTS, dtype=torch.uint8, pin_memory=True)
        per = PART // PAGE
        order = torch.randperm(pages, device="cuda")
        self.idx = [order[i * per:(i + 1) * per] for i in range(PARTS)]
        self.staging = torch.empty(DEPTH * per, words, device="cuda", dtype=torch.int64)
        self.parts = [self.staging[i * per:(i + 1) * per] for i in range(DEPTH)]
        self.sums = torch.empty(DEPTH, per, device="cuda", dtype=torch.int64)
        self.gather_stream = torch.cuda.Stream()
        self.copy_stream = torch.cuda.Stream()
        self.read_stream = torch.cuda.Stream()

    def round(self, shape):
        """One round; returns (bytes, seconds while copying, seconds overall)."""
        ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        starts, ends = [], []
        cs = self.copy_stream
        if shape == "one":
            s, e = ev(), ev()
            with torch.cuda.stream(cs):
                s.record(cs)
                self.host.copy_(self.flat, non_blocking=True)
                e.record(cs)
            starts, ends = [s], [e]
        elif shape in ("split", "split+read", "split+write", "split+wait"):
            per = PART // PAGE
            marks = []
            if shape == "split+wait":
                # Every copy's gate queued first: tiny kernels, each recording an event.
                with torch.cuda.stream(self.gather_stream):
                    for j in range(PARTS):
                        self.sums[0, :1].fill_(j)
                        m = torch.cuda.Event()
                        m.record(self.gather_stream)
                        marks.append(m)
            for j in range(PARTS):
                if shape == "split+read":
                    with torch.cuda.stream(self.read_stream):
                        part = self.pool[j * per:(j + 1) * per]
                        torch.sum(part, dim=1, out=self.sums[j % DEPTH])
                elif shape == "split+write":
                    with torch.cuda.stream(self.read_stream):
                        torch.index_select(self.pool, 0, self.idx[j], out=self.parts[j % DEPTH])
                with torch.cuda.stream(cs):
                    if marks:
                        cs.wait_event(marks[j])
                    s, e = ev(), ev()
                    s.record(cs)
                    self.host[j * PART:(j + 1) * PART].copy_(
                        self.flat[j * PART:(j + 1) * PART], non_blocking=True
                    )
                    e.record(cs)
                    starts.append(s)
                    ends.append(e)
        else:
            read = shape == "piped+read"
            gs, rs = self.gather_stream, self.read_stream
            free = [None] * DEPTH  # events after which a staging part may be overwritten
            for j in range(PARTS):
                p = j % DEPTH
                gathered = torch.cuda.Event()
                with torch.cuda.stream(gs):
                    for f in free[p] or []:
                        gs.wait_event(f)
                    torch.index_select(self.pool, 0, self.idx[j], out=self.parts[p])
                    gathered.record(gs)
                waits = []
                if read:
                    summed = torch.cuda.Event()
                    with torch.cuda.stream(rs):
                        rs.wait_event(gathered)
                        torch.sum(self.parts[p], dim=1, out=self.sums[p])
                        summed.record(rs)
                    waits.append(summed)
                s, e = ev(), ev()
                with torch.cuda.stream(cs):
                    cs.wait_event(gathered)
                    s.record(cs)
                    self.host[j * PART:(j + 1) * PART].copy_(
                        self.parts[p].view(-1).view(torch.uint8), non_blocking=True
                    )
                    e.record(cs)
                waits.append(e)
                free[p] = waits
                starts.append(s)
                ends.append(e)
        torch.cuda.synchronize()
        copying = sum(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3
        overall = starts[0].elapsed_time(ends[-1]) / 1e3
        return PART * PARTS, copying, overall

    def run(self, shape, seconds):
        """Rounds for `seconds`; returns (GB/s while copying, GB/s overall)."""
        total = copying = overall = 0.0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            b, c, o = self.round(shape)
            total, copying, overall = total + b, copying + c, overall + o
        return total / copying / 1e9, total / overall / 1e9


def main():
    out = sys.argv[1]
    shapes = sys.argv[2:] or [
        "one", "split", "split+read", "split+write", "split+wait", "piped", "piped+read"
    ]
    torch.cuda.set_device(0)
    c = Copier()
    rows = {}
    for shape in shapes:
        c.run(shape, 0.5)  # warm
        busy, overall = c.run(shape, WINDOW_S)
        rows[shape] = {"alone_busy_gbs": busy, "alone_overall_gbs": overall}
        print(f"{shape:10} alone: {busy:.1f} GB/s while copying, {overall:.1f} overall", flush=True)
    m = residency.Matmul()
    try:
        m.rate(WINDOW_S)  # warm
        before = m.rate(WINDOW_S)
        for shape in shapes:
            result = {}
            t = Thread(target=lambda: result.update(r=c.run(shape, WINDOW_S + 1.0)))
            t.start()
            time.sleep(0.5)
            beside = m.rate(WINDOW_S)
            t.join()
            after = m.rate(WINDOW_S)
            alone = (before + after) / 2
            busy, overall = result["r"]
            rows[shape].update(
                beside_busy_gbs=busy,
                beside_overall_gbs=overall,
                matmul_alone_per_s=alone,
                matmul_alone_spread=abs(before - after) / alone,
                matmul_slowdown=1 - beside / alone,
            )
            print(
                f"{shape:10} beside the matmul: {busy:.1f} GB/s while copying, {overall:.1f} "
                f"overall; matmul slowdown {100 * (1 - beside / alone):.2f}% (alone "
                f"{before:.1f} / {after:.1f} per s)",
                flush=True,
            )
            before = after
        json.dump({"rows": rows}, open(out, "w"), indent=1)
    finally:
        m.stop()


if __name__ == "__main__":
    main()
