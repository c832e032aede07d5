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


def markdown(result: Dict[str, Any]) -> str:
    runs = result["runs"]
    lines = []
    for w in result["protocol"]["workloads"]:
        lines += [f"### {w}", "",
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
    checks = probes_check(runs)
    lines += ["", "### greedy probes", "",
              "| run | second pass = first | = engine alone |", "| --- | --- | --- |"]
    for k, v in checks.items():
        lines.append(f"| {k} | {v['after_equals_before']} | {v['equals_engine_alone']} |")
    return "\n".join(lines) + "\n"
