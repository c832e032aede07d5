#!/usr/bin/env python3
"""The interference runs of device-ab.sh as a markdown table: one row per run (a1, b1, a2,
...), then one per side with the range of its runs. Reads summarize-gpu.py's lines (the
ab-summary.txt device-ab.sh leaves, or a device-pack.sh NAME-summary.txt). Usage:
ab-table.py SUMMARY [SUMMARY ...] (runs of the second file on are marked with its number;
sides are summed over all); a file it cannot read is named with the reason. Columns:
the alone ratios (save / load), the server's rows beside the matmul (slowdown at GB/s), the
copy engines alone (engine-side save / load), and the saves' copies while copying beside the
matmul (with --gpu-timeline)."""

import re
import sys

COLUMNS = [
    ("alone save / load", r"^(\S+)-gpu-intf-\S+: save / load ([\d.]+) / ([\d.]+);", "ratio"),
    ("server save", r"^(\S+)-gpu-intf-\S+:\s+beside server save: slowdown ([\d.]+)% .* at ([\d.]+) GB/s", "row"),
    ("server load", r"^(\S+)-gpu-intf-\S+:\s+beside server load: slowdown ([\d.]+)% .* at ([\d.]+) GB/s", "row"),
    ("streamed save", r"^(\S+)-gpu-intf-\S+:\s+beside server-stream save: slowdown ([\d.]+)% .* at ([\d.]+) GB/s", "row"),
    ("streamed load", r"^(\S+)-gpu-intf-\S+:\s+beside server-stream load: slowdown ([\d.]+)% .* at ([\d.]+) GB/s", "row"),
    ("engine-side save", r"^(\S+)-gpu-intf-\S+:\s+beside engine-side save: slowdown ([\d.]+)% .* at ([\d.]+) GB/s", "row"),
    ("engine-side load", r"^(\S+)-gpu-intf-\S+:\s+beside engine-side load: slowdown ([\d.]+)% .* at ([\d.]+) GB/s", "row"),
    ("saves' copies beside", r"^(\S+)-gpu-intf-\S+:\s+beside-matmul save timeline: copies at ([\d.]+) GB/s", "rate"),
]


def parse(lines, label=""):
    """{run tag + label: {column: (a, b) or (a,)}}, runs in the order first seen."""
    runs = {}
    for line in lines:
        for name, pattern, _ in COLUMNS:
            m = re.match(pattern, line)
            if m:
                values = tuple(float(v) for v in m.groups()[1:])
                runs.setdefault(m.group(1) + label, {})[name] = values
    return runs


def cell(kind, v):
    if v is None:
        return "-"
    if kind == "ratio":
        return f"{v[0]:.3f} / {v[1]:.3f}"
    if kind == "row":
        return f"{v[0]:.2f}% at {v[1]:.1f}"
    return f"{v[0]:.1f}"


def span(kind, vs):
    """The range of a side's runs in one column."""
    vs = [v for v in vs if v is not None]
    if not vs:
        return "-"

    def rng(i, fmt):
        lo, hi = min(v[i] for v in vs), max(v[i] for v in vs)
        return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"

    if kind == "ratio":
        return f"{rng(0, '{:.3f}')} / {rng(1, '{:.3f}')}"
    if kind == "row":
        return f"{rng(0, '{:.2f}')}% at {rng(1, '{:.1f}')}"
    return rng(0, "{:.1f}")


def table(runs):
    out = ["| run | " + " | ".join(n for n, _, _ in COLUMNS) + " |"]
    out.append("| --- |" + " --- |" * len(COLUMNS))
    for tag, cols in runs.items():
        out.append(f"| {tag} | " + " | ".join(cell(k, cols.get(n)) for n, _, k in COLUMNS) + " |")
    sides = {}
    for tag, cols in runs.items():
        sides.setdefault(re.match(r"[a-z]+", tag).group(0), []).append(cols)
    for side, all_cols in sides.items():
        if len(all_cols) < 2:
            continue
        cells = [span(k, [c.get(n) for c in all_cols]) for n, _, k in COLUMNS]
        out.append(f"| {side.upper()} ({len(all_cols)} runs) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(paths):
    runs = {}
    for i, p in enumerate(paths):
        try:
            with open(p) as f:
                lines = f.read().splitlines()
        except OSError as e:
            print(f"{p}: {e}", file=sys.stderr)
            continue
        # Calls reuse tags (a1, b1, ...): runs of the second file on are marked with its number.
        runs.update(parse(lines, f" (file {i + 1})" if i else ""))
    if not runs:
        print("no interference runs found", file=sys.stderr)
        return 1
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
