#!/usr/bin/env python3
"""One line per result of the device scripts' JSON files in a folder (their $OUT): ratios
against the ceiling, the checksums, the interference rows, the server's counters and the
checks of the server's stats. Usage: summarize-gpu.py DIR [DIR ...]. Prints what it finds;
a file it cannot read is named with the reason."""

import glob
import json
import os
import sys


def num(v, fmt="{:.3f}"):
    return "?" if v is None else fmt.format(v)


def local(name, d):
    """perf/scripts/device-dma.sh: dma-TAGname.json."""
    for r in d.get("results", []):
        # "(blocks)" / "(pieces)": how a staged strategy was planned, where the JSON says.
        form = lambda s: (
            "" if not s.get("staged") or s.get("blocks") is None
            else " (blocks)" if s["blocks"] else " (pieces)"
        )
        rows = ", ".join(f"{s['strategy']}{form(s)} {num(s['ratio'])}" for s in r["strategies"])
        print(f"{name}: {r['direction']} ceiling {num(r['ceiling_gbps'], '{:.1f}')} GB/s: {rows}")
    c = d.get("checksums")
    if c:
        # The form (--checksum-form) where the JSON names it; the saved bytes' check of a fused one.
        wrong_bytes = c.get("mismatched_bytes")
        print(
            f"{name}: checksums{' (' + c['form'] + ')' if c.get('form') else ''} {c['chunks']} "
            f"chunks, {c['mismatches']} wrong"
            f"{'' if wrong_bytes is None else f', {wrong_bytes} wrong bytes saved'}, alone "
            f"{num(c['gbps_alone'], '{:.0f}')} GB/s, save with them {num(c['save_ratio_with_checksums'])}"
        )
        t = c.get("timeline")
        if t:
            print(
                f"{name}:   checksummed save timeline: copies at {num(t['copy_gbps'], '{:.1f}')} "
                f"GB/s while copying, gaps {num(t['copy_gaps_us'], '{:.0f}')} us, kernel "
                f"{num(t['kernel_mean_us'], '{:.0f}')} us mean"
            )
    interference(name, d.get("interference"))


def interference(name, i):
    if not i:
        return
    # Since the windows alone bracket every measurement (solo_per_s): how far the loop drifted
    # by itself, and per row the median and range over the rounds.
    solos = i.get("solo_per_s")
    drift = (
        f"; {len(solos)} windows alone {num(100 * i['solo_spread'], '{:.2f}')}% apart at most, "
        f"{i['rounds']} round(s)"
        if solos
        else ""
    )
    print(
        f"{name}: matmul alone {num(i['matmul_per_s_alone'], '{:.1f}')}/s, after "
        f"{num(i['matmul_per_s_alone_after'], '{:.1f}')}/s{drift}"
    )
    for r in i["rows"]:
        spread = (
            f" (rounds {num(100 * r['slowdown_min'], '{:.2f}')}-"
            f"{num(100 * r['slowdown_max'], '{:.2f}')}%)"
            if len(r.get("slowdowns") or []) > 1
            else ""
        )
        print(
            f"{name}:   beside {r['strategy']} {r['direction']}: slowdown "
            f"{num(100 * r['slowdown'], '{:.2f}')}%{spread} at {num(r['copy_gbps'], '{:.1f}')} GB/s"
        )


def served(name, d):
    """perf/scripts/device-gpu-server.sh: TAGgpu-name.json."""
    s = d.get("server") or {}
    ratios = " / ".join(num(r["strategies"][0]["ratio"]) for r in d.get("results", []))
    print(
        f"{name}: save / load {ratios}; failures {s.get('save_failures')} / "
        f"{s.get('load_failures')}; mismatched bytes {s.get('save_mismatched_bytes')} / "
        f"{s.get('load_mismatched_bytes')}"
    )
    # Against the ceiling's copy just before and after each timed save / load.
    if s.get("save_ratio_bracketed") is not None:
        span = lambda r: f"{min(r):.3f}-{max(r):.3f}" if r else "-"
        print(
            f"{name}:   bracketed {num(s.get('save_ratio_bracketed'))} / "
            f"{num(s.get('load_ratio_bracketed'))} (each: "
            f"{span(s.get('save_bracketed_ratios') or [])} / "
            f"{span(s.get('load_bracketed_ratios') or [])}); ceiling windows "
            + " ".join(f"{w:.1f}" for w in s.get("save_ceiling_windows_gbps") or [])
            + " / "
            + " ".join(f"{w:.1f}" for w in s.get("load_ceiling_windows_gbps") or [])
            + " GB/s"
        )
    print(
        f"{name}:   busy {num(s.get('save_busy_gbps'), '{:.1f}')} / "
        f"{num(s.get('load_busy_gbps'), '{:.1f}')} GB/s; per job submit "
        f"{num(s.get('save_submit_us_per_job'), '{:.0f}')} / "
        f"{num(s.get('load_submit_us_per_job'), '{:.0f}')} us, checksum wait "
        f"{num(s.get('save_checksum_wait_us_per_job'), '{:.0f}')} us; host copies per job "
        f"{num(s.get('save_runs_per_job'), '{:.1f}')}"
    )
    if s.get("save_submit_cpu_us_per_job") is not None:
        print(
            f"{name}:   DMA threads' own CPU per job "
            f"{num(s.get('save_submit_cpu_us_per_job'), '{:.0f}')} / "
            f"{num(s.get('load_submit_cpu_us_per_job'), '{:.0f}')} us, of which waiting for "
            f"the GPU {num(s.get('save_submit_wait_us_per_job'), '{:.0f}')} / "
            f"{num(s.get('load_submit_wait_us_per_job'), '{:.0f}')} us"
        )
    for way in ("save", "load"):
        p = s.get(f"{way}_submit_parts")
        if p:
            print(
                f"{name}:   {way} thread per job: pieces {p['pieces_us']:.0f} us, staged batches "
                f"{p['stage_us']:.0f} us, checksum tables {p['tables_us']:.0f} us, CUDA calls "
                f"and the rest {p['cuda_us']:.0f} us"
            )
    # The requests' time with no copy of theirs running: before the first, after the last
    # (lead, tail; per request) and between jobs (the rest).
    idle = lambda way: (
        1 - s[f"{way}_gbps"] / s[f"{way}_busy_gbps"] if s.get(f"{way}_busy_gbps") else None
    )
    print(
        f"{name}:   idle {num(idle('save') and 100 * idle('save'), '{:.1f}')}% / "
        f"{num(idle('load') and 100 * idle('load'), '{:.1f}')}% of the requests' time; lead "
        f"{num(s.get('save_lead_us'), '{:.0f}')} / {num(s.get('load_lead_us'), '{:.0f}')} us, tail "
        f"{num(s.get('save_tail_us'), '{:.0f}')} / {num(s.get('load_tail_us'), '{:.0f}')} us"
        + (
            f"; DMA thread wake-up {num(s.get('save_pickup_us'), '{:.0f}')} / "
            f"{num(s.get('load_pickup_us'), '{:.0f}')} us"
            if s.get("save_pickup_us") is not None or s.get("load_pickup_us") is not None
            else ""
        )
    )
    # With the server's --gpu-timeline: the copies' own rate and the copy stream's idle time,
    # alone and (with --interference) beside the matmul.
    beside = s.get("beside_matmul") or {}
    for way, t in (("save", s.get("save_timeline")), ("load", s.get("load_timeline")),
                   ("beside-matmul save", beside.get("save_timeline")),
                   ("beside-matmul load", beside.get("load_timeline"))):
        if t:
            print(
                f"{name}:   {way} timeline: copies at {num(t['copy_gbps'], '{:.1f}')} GB/s while "
                f"copying; per request {num(t['span_us'], '{:.0f}')} us on the GPU, copy stream "
                f"idle {num(t['copy_gaps_us'], '{:.0f}')} us, kernels {num(t['kernel_us'], '{:.0f}')} us"
                f"{'' if t.get('periods_per_request') is None else ', busy periods ' + num(t['periods_per_request'], '{:.2f}')}"
                f"{'' if t.get('lead_us') is None else ', before the first copy ' + num(t['lead_us'], '{:.0f}') + ' us'}"
                f"{'' if t.get('tail_us') is None else ', after the last ' + num(t['tail_us'], '{:.0f}') + ' us'}"
            )
    dup = s.get("duplex")
    if dup:
        print(f"{name}:   duplex {num(dup['ratio'])} ({num(dup['gbps'], '{:.1f}')} of "
              f"{num(dup['ceiling_gbps'], '{:.1f}')} GB/s)")
    interference(name, d.get("interference"))
    b = s.get("beside_matmul")
    if b:
        print(
            f"{name}:   server beside the matmul: saves {num(b['save_busy_gbps'], '{:.1f}')} GB/s "
            f"busy, checksum wait {num(b['save_checksum_wait_us_per_job'], '{:.0f}')} us per job; "
            f"loads {num(b['load_busy_gbps'], '{:.1f}')} GB/s busy"
            + (f"; streamed saves {num(b['stream_save_busy_gbps'], '{:.1f}')}, loads "
               f"{num(b['stream_load_busy_gbps'], '{:.1f}')} GB/s busy"
               if "stream_save_busy_gbps" in b else "")
        )


def stats(name, d):
    """The server's `orbitkv-ctl stats --json` after a run."""
    g = d.get("gpu_transfers", {})
    shards = d.get("shards", [])
    total = lambda k: sum(x.get(k, 0) for x in shards)
    print(
        f"{name}: state {d.get('state')}, sessions {d.get('sessions')}, leases {total('leases')}, "
        f"registrations {g.get('registrations')}, failed jobs {g.get('failed_jobs')}; GPU "
        f"checksums {total('gpu_checksums')} ({total('gpu_checksums_verified')} checked, "
        f"{total('gpu_checksum_mismatches')} wrong); requests orphaned by their client "
        f"{total('orphaned_requests') if any('orphaned_requests' in x for x in shards) else '-'}"
    )


def cpu_checksum(name, d):
    """orbitkv-perf checksum: the host's cores hashing chunks."""
    rows = ", ".join(
        f"{r['threads']} threads {num(r['gbps'], '{:.1f}')} GB/s ({num(r['gbps_per_thread'], '{:.1f}')} each)"
        for r in d["rows"]
    )
    print(f"{name}: xxh3 of {d['value_size']}-byte chunks, memcpy {num(d['memcpy_gbps'], '{:.1f}')} GB/s: {rows}")


def residency(name, d):
    """perf/scripts/device-residency.py: the matmul beside kernels that only wait."""
    for r in d["rows"]:
        print(
            f"{name}: {r['grid']} blocks for {r['dur_us']} us every {r['period_us']} us: slowdown "
            f"{num(100 * r['slowdown'], '{:.2f}')}% (resident {num(100 * r['resident_share'], '{:.1f}')}% "
            f"of the time, SM time {num(100 * r['sm_time_share'], '{:.2f}')}%; solo windows "
            f"{num(100 * r['alone_spread'], '{:.2f}')}% apart)"
        )


def standby(name, d):
    """perf/scripts/device-standby.py: launched against resident copy kernels beside the matmul."""

    def times(r):
        if not r or "error" in r:
            return (r or {}).get("error", "no result")
        timed = "; ".join(
            f"{what} median {num(s['median'], '{:.0f}')} us, p90 {num(s['p90'], '{:.0f}')}"
            for what, s in (("host", r.get("host_us")), ("GPU", r.get("gpu_us")))
            if s
        ) or "nothing timed"
        return timed + (f" ({r['failed']} not answered within 1 s)" if r.get("failed") else "")

    for r in d["rows"]:
        m = r.get("matmul")
        cost = (
            f"; matmul slowdown {num(100 * m['slowdown'], '{:.2f}')}% (solo windows "
            f"{num(100 * m['alone_spread'], '{:.2f}')}% apart)"
            if m
            else ""
        )
        print(
            f"{name}: {r['mode']} {r['mib']} MiB, {r['grid']} blocks, every {r['period_us']} us: "
            f"alone {times(r.get('alone'))}; beside the matmul {times(r.get('beside'))}{cost}"
        )


def main(dirs):
    for folder in dirs:
        for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
            name = os.path.basename(path)[: -len(".json")]
            try:
                with open(path) as f:
                    d = json.load(f)
            except (OSError, ValueError) as e:
                if "killed" in name:
                    # The engine killed in the middle of its save writes no result.
                    print(f"{name}: no result (the engine was killed during its save)")
                else:
                    print(f"{name}: not read ({e})")
                continue
            if "stats" in name:
                stats(name, d)
            elif "rows" in d and "memcpy_gbps" in d:
                cpu_checksum(name, d)
            elif "rows" in d and name == "residency":
                residency(name, d)
            elif "rows" in d and name == "standby":
                standby(name, d)
            elif "server" in d and d["server"] is not None:
                served(name, d)
            elif "results" in d:
                local(name, d)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: summarize-gpu.py DIR [DIR ...]")
    main(sys.argv[1:])
