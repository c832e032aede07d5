"""The serving benchmark's report: paired comparisons between cases and the markdown table."""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Tuple

#: (case A, case B, what B/A of mean TTFT says, the goal as (op, bound) or None).
COMPARISONS: List[Tuple[str, str, str, Optional[Tuple[str, float]]]] = [
    ("engine", "orbitkv-dram", "OrbitKV (DRAM) against the engine alone", ("<=", 1 / 3)),
    ("ideal", "orbitkv-dram", "OrbitKV (DRAM) against the ideal engine cache", ("<=", 1.25)),
    ("orbitkv-dram", "orbitkv-ssd", "the SSD tier serving against DRAM", ("<=", 1.5)),
    ("orbitkv-dram", "orbitkv-warm-ssd", "a warm SSD after restart against DRAM", ("<=", 1.5)),
    ("engine", "ideal", "the ideal cache against the engine alone", None),
    ("engine", "vllm-offload", "vLLM's CPU offloading against the engine alone", None),
    ("vllm-offload", "orbitkv-dram", "OrbitKV (DRAM) against vLLM's CPU offloading", None),
]

METRICS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "output_throughput", "duration_s")


def by_round(runs: List[Dict[str, Any]], case: str) -> Dict[int, Dict[str, Any]]:
    return {r["round"]: r for r in runs if r["case"] == case and r.get("ran")}


def paired(runs: List[Dict[str, Any]], a: str, b: str, workload: str, metric: str) -> List[float]:
    """B/A of `metric` in each round where both ran."""
    ra, rb = by_round(runs, a), by_round(runs, b)
    out = []
    for rnd in sorted(set(ra) & set(rb)):
        va = ra[rnd]["workloads"][workload].get(metric)
        vb = rb[rnd]["workloads"][workload].get(metric)
        if va and vb is not None:
            out.append(vb / va)
    return out


def comparisons(runs: List[Dict[str, Any]], workloads: List[str]) -> List[Dict[str, Any]]:
    out = []
    for w in workloads:
        for a, b, what, goal in COMPARISONS:
            entry: Dict[str, Any] = {"workload": w, "a": a, "b": b, "what": what}
            for m in METRICS:
                ratios = paired(runs, a, b, w, m)
                if ratios:
                    entry[m] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                "pairs": len(ratios)}
            if "mean_ttft_ms" not in entry:
                continue
            if goal is not None:
                op, bound = goal
                med = entry["mean_ttft_ms"]["median"]
                entry["goal"] = f"mean TTFT B/A {op} {bound:.3g}"
                entry["goal_met"] = med <= bound if op == "<=" else med >= bound
            out.append(entry)
    return out


def probes_check(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Greedy outputs of the probes: each run's second pass against its first, and every run
    against the engine alone's first pass of the same round."""
    ref = {r["round"]: [p["output_ids"] for p in r["probes_before"]] for r in runs
           if r["case"] == "engine" and r.get("ran")}
    out: Dict[str, Any] = {}
    for r in runs:
        if not r.get("ran"):
            continue
        before = [p["output_ids"] for p in r["probes_before"]]
        after = [p["output_ids"] for p in r["probes_after"]]
        key = f"{r['case']}-r{r['round']}"
        out[key] = {"after_equals_before": before == after,
                    "equals_engine_alone": (before == ref[r["round"]] and after == ref[r["round"]])
                    if r["round"] in ref else None}
    return out


def fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def medians(runs: List[Dict[str, Any]], workload: str) -> List[str]:
    """One row per case: the median over its runs of each figure, and the range of mean TTFT."""
    rows = ["| case | mean TTFT ms (median [range]) | p50 | p99 | mean request ms | output tok/s | run s | "
            "external hits | loaded MiB | saved MiB | failed requests | failed block loads | runs |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    seen: List[str] = []
    for r in runs:
        if r["case"] not in seen:
            seen.append(r["case"])
    for case in seen:
        ran = [r["workloads"][workload] for r in runs if r["case"] == case and r.get("ran")]
        if not ran:
            why = next((r.get("why_not") for r in runs if r["case"] == case), "")
            rows.append(f"| {case} | did not run: {why} |" + " |" * 11)
            continue

        def med(k: str) -> float:
            return statistics.median(float(x.get(k) or 0.0) for x in ran)

        ttft = [x["mean_ttft_ms"] for x in ran]
        load_errors = sum(int(((r.get("connector") or {}).get("worker") or {}).get("load_error_blocks") or 0)
                          for r in runs if r["case"] == case and r.get("ran"))
        rows.append(
            f"| {case} | {med('mean_ttft_ms'):.1f} [{min(ttft):.1f}, {max(ttft):.1f}] | {med('median_ttft_ms'):.1f} | "
            f"{med('p99_ttft_ms'):.1f} | {med('mean_e2el_ms'):.1f} | {med('output_throughput'):.1f} | {med('duration_s'):.1f} | "
            f"{med('external_hit_rate'):.2f} | {med('loaded_bytes') / (1 << 20):.0f} | "
            f"{med('saved_bytes') / (1 << 20):.0f} | {sum(int(x.get('failed') or 0) for x in ran)} | {load_errors} | "
            f"{len(ran)} |")
    return rows


def ttft_by_round(runs: List[Dict[str, Any]]) -> List[str]:
    """Multiturn: mean TTFT of each conversation round (round 0: first contexts, nothing to
    reuse), the median over the runs of a case."""
    per_case: Dict[str, List[Dict[str, float]]] = {}
    for r in runs:
        x = (r.get("workloads") or {}).get("multiturn") or {}
        if r.get("ran") and x.get("mean_ttft_ms_by_round"):
            per_case.setdefault(r["case"], []).append(x["mean_ttft_ms_by_round"])
    if not per_case:
        return []
    rounds = sorted({k for v in per_case.values() for d in v for k in d}, key=int)
    rows = ["| case | " + " | ".join(f"round {k} TTFT ms" for k in rounds) + " |",
            "| --- |" + " --- |" * len(rounds)]
    for case, ds in per_case.items():
        cells = [f"{statistics.median(d[k] for d in ds if k in d):.1f}" for k in rounds]
        rows.append(f"| {case} | " + " | ".join(cells) + " |")
    return rows


def markdown(result: Dict[str, Any]) -> str:
    runs = result["runs"]
    lines = []
    for w in result["protocol"]["workloads"]:
        lines += [f"### {w}: medians over the rounds", ""] + medians(runs, w) + [""]
        if w == "multiturn" and ttft_by_round(runs):
            lines += ["### multiturn: mean TTFT by conversation round (median over the runs)", ""]
            lines += ttft_by_round(runs) + [""]
    for w in result["protocol"]["workloads"]:
        lines += [f"### {w}: every run", "",
                  "| case | round | mean TTFT ms | p50 | p99 | output tok/s | duration s | failed | engine hits | "
                  "external hits | loaded MiB | saved MiB |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in runs:
            if not r.get("ran"):
                lines.append(f"| {r['case']} | {r['round']} | did not run: {r.get('why_not')} |"
                             + " |" * 9)
                continue
            x = r["workloads"][w]
            lines.append(
                f"| {r['case']} | {r['round']} | {fmt(x.get('mean_ttft_ms'))} | {fmt(x.get('median_ttft_ms'))} | "
                f"{fmt(x.get('p99_ttft_ms'))} | {fmt(x.get('output_throughput'))} | {fmt(x.get('duration_s'))} | "
                f"{x.get('failed')} | {x['engine_hit_rate']:.2f} | {x['external_hit_rate']:.2f} | "
                f"{x['loaded_bytes'] / (1 << 20):.0f} | {x['saved_bytes'] / (1 << 20):.0f} |")
        lines.append("")
    lines += ["### paired comparisons (B/A per round: median [min, max])", "",
              "| workload | B against A | mean TTFT | p50 TTFT | p99 TTFT | output tok/s | pairs | goal |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def cell(e: Dict[str, Any], m: str) -> str:
        if m not in e:
            return "-"
        v = e[m]
        return f"{v['median']:.2f} [{v['min']:.2f}, {v['max']:.2f}]"

    for e in result["comparisons"]:
        goal = f"{e['goal']}: {'met' if e['goal_met'] else 'missed'}" if "goal" in e else ""
        lines.append(f"| {e['workload']} | {e['b']} / {e['a']} | {cell(e, 'mean_ttft_ms')} | "
                     f"{cell(e, 'median_ttft_ms')} | {cell(e, 'p99_ttft_ms')} | {cell(e, 'output_throughput')} | "
                     f"{e['mean_ttft_ms']['pairs']} | {goal} |")
    profiled = [r for r in runs if r.get("profile")]
    if profiled:
        cats = ["model forward", "orbitkv connector", "orbitkv client", "scheduler", "other"]
        lines += ["", "### CPU profile of the engine's processes during the workloads (py-spy, share of samples)", "",
                  "| run | process | " + " | ".join(cats) + " | samples |", "| --- | --- |" + " --- |" * (len(cats) + 1)]
        for r in profiled:
            for proc, sh in r["profile"].items():
                cells = " | ".join(f"{100 * sh.get(c, 0.0):.1f}%" for c in cats)
                lines.append(f"| {r['case']}-r{r['round']} | {proc} | {cells} | {int(sh.get('samples', 0))} |")
    checks = probes_check(runs)
    lines += ["", "### greedy probes", "",
              "| run | second pass = first | = engine alone |", "| --- | --- | --- |"]
    for k, v in checks.items():
        lines.append(f"| {k} | {v['after_equals_before']} | {v['equals_engine_alone']} |")
    return "\n".join(lines) + "\n"
