"""The connector's worker side driven through vLLM's model-runner steps against a fake Manager
(`fake_native`, no orbitkv-server), with a CPU KV cache: saves gathered into chunks and loaded
back into other blocks, async and sync loads, a load error per block, a request finished while
its saves run, loads before queued saves, saves refused or already present, a TP rank's own
namespace, and a Manager that is down and comes back. Each asserts what the connector reports to
vLLM (finished sending and receiving, blocks that failed to load, stats) and what the Manager saw
(keys saved and loaded, their bytes, every lease released)."""

from __future__ import annotations

import os
import threading

import pytest

pytest.importorskip("vllm.logger") if not os.environ.get("ORBITKV_REQUIRE_VLLM") else __import__("vllm.logger")
torch = pytest.importorskip("torch")

import fake_native  # noqa: E402
import vllm_parts as vp  # noqa: E402
from vllm_parts import CHUNK, Steps, connectors, log  # noqa: E402, F401 (fixtures, passed by name)

WORKER = "vllm-worker-0"


@pytest.fixture
def manager(monkeypatch):
    monkeypatch.setattr("orbitkv.vllm.worker._tp_rank", lambda: 0)
    return fake_native.install(monkeypatch)


def block_bytes(kv, b: int) -> bytes:
    """Block `b`'s chunk: its bytes in each layer, in turn."""
    return b"".join(t[b].numpy().tobytes() for t in kv.values())


def test_saved_blocks_are_chunks_that_load_back_into_other_blocks(manager, connectors):
    conn, kv = connectors.worker(load_mode="async")
    steps = Steps(conn)
    cfg = vp.vllm_config()
    r = vp.request("s", vp.prompt(3, seed=1))
    d = vp.digests(r)
    assert steps.run(vp.metadata(saves={"s": [(0, d, [1, 2, 3])]})).finished_sending is None
    steps.saved("s")
    (save,) = manager.recorded("save_blocks", WORKER)
    assert save.keys == tuple(vp.keys(cfg, r)) and save.blocks == (1, 2, 3) and save.outcomes == ("stored",) * 3
    for k, b in zip(save.keys, (1, 2, 3)):
        assert manager.chunks[k] == block_bytes(kv, b), f"block {b}'s layers, in order"
    # Saved, but reported only once vLLM says the request finished.
    assert steps.run().finished_sending is None
    assert steps.run(finished={"s"}).finished_sending == {"s"}
    assert steps.run().finished_sending is None, "reported once"
    before = {name: t.clone() for name, t in kv.items()}
    out = steps.until_received(vp.metadata(loads={"l": [(0, d, [5, 6, 7])]}))
    assert out.finished_recving == {"l"} and out.invalid_block_ids == set() and out.failed_recving == set()
    for name, t in kv.items():
        for src, dst in ((1, 5), (2, 6), (3, 7)):
            assert torch.equal(t[dst], before[name][src]), f"{name}: block {src} loaded into {dst}"
        assert torch.equal(t[4], before[name][4]) and torch.equal(t[0], before[name][0])
    (load,) = manager.recorded("load_blocks", WORKER)
    assert load.keys == save.keys and load.outcomes == ("done",) * 3
    assert (steps.stats["saved_blocks"], steps.stats["save_bytes"]) == (3, 3 * CHUNK)
    assert (steps.stats["loaded_blocks"], steps.stats["load_bytes"], steps.stats["load_error_blocks"]) == (
        3, 3 * CHUNK, 0)


@pytest.mark.parametrize("fault", ["the Manager's answer", "a chunk of another length"])
def test_a_chunk_that_fails_to_load_is_reported_per_block(manager, connectors, fault):
    conn, kv = connectors.worker(load_mode="async")
    steps = Steps(conn)
    cfg = vp.vllm_config()
    r = vp.request("e", vp.prompt(3, seed=2))
    d = vp.digests(r)
    steps.run(vp.metadata(saves={"e": [(0, d, [1, 2, 3])]}))
    steps.saved("e")
    broken = vp.keys(cfg, r)[1]
    if fault == "the Manager's answer":
        manager.fail_load(broken)
    else:
        manager.store(broken, b"x" * 10)
    before = {name: t.clone() for name, t in kv.items()}
    out = steps.until_received(vp.metadata(loads={"l": [(0, d, [5, 6, 7])]}))
    # The first chunk loads; the second fails and nothing after it loads: both blocks are
    # reported in the step that reports the load, for vLLM's kv_load_failure_policy.
    assert out.finished_recving == {"l"} and out.invalid_block_ids == {6, 7}
    assert out.failed_recving == set(), "one KV cache group: per block, not per request"
    (load,) = manager.recorded("load_blocks", WORKER)
    assert load.outcomes == ("done", "invalid_argument", "not_found")
    for name, t in kv.items():
        assert torch.equal(t[5], before[name][1])
        assert torch.equal(t[6], before[name][6]) and torch.equal(t[7], before[name][7]), "left as they were"
    assert steps.run().invalid_block_ids == set(), "reported once"
    assert (steps.stats["loaded_blocks"], steps.stats["load_error_blocks"]) == (1, 2)
    steps.run(finished={"e"})


def test_sync_loads_land_before_the_forward_pass_and_report_errors_in_that_step(manager, connectors):
    conn, kv = connectors.worker()  # a CPU KV cache's default: sync loads
    steps = Steps(conn)
    r = vp.request("z", vp.prompt(3, seed=3))
    d = vp.digests(r)
    steps.run(vp.metadata(saves={"z": [(0, d[:2], [1, 2])]}))
    steps.saved("z")
    before = {name: t.clone() for name, t in kv.items()}
    conn.bind_connector_metadata(vp.metadata(loads={"l": [(0, d, [5, 6, 7])]}))
    conn.start_load_kv(None)
    # Before the forward pass: blocks 1-2 in place; block 3 was never saved.
    for name, t in kv.items():
        assert torch.equal(t[5], before[name][1]) and torch.equal(t[6], before[name][2])
        assert torch.equal(t[7], before[name][7])
    conn.wait_for_save()
    res = conn.get_transfer_results(set())
    assert (res.finished_recving, res.finished_sending) == (set(), set()), "a sync load is no transfer to report"
    assert conn.get_block_ids_with_load_errors() == {7}
    assert conn.get_block_ids_with_load_errors() == set()
    conn.clear_connector_metadata()
    steps.run(finished={"z"})


def test_a_request_finished_while_its_saves_run_is_reported_once_they_end(manager, connectors):
    gate = manager.hold("save")
    conn, kv = connectors.worker(load_mode="async")
    steps = Steps(conn)
    w = vp.request("w", vp.prompt(2, seed=4))
    d = vp.digests(w)
    steps.run(vp.metadata(saves={"w": [(0, d, [1, 2])]}))
    gate.wait_entered()
    # Finished while its save runs: vLLM keeps its blocks until finished_sending names it.
    assert steps.run(finished={"w"}).finished_sending is None
    assert steps.run().finished_sending is None
    # A preemption of it waits for the save (the thread is still waiting when the gate opens;
    # this check can only pass wrongly, never fail wrongly).
    preempt = threading.Thread(target=conn.handle_preemptions, args=(vp.metadata(preempted=["w"]),))
    preempt.start()
    preempt.join(0.2)
    assert preempt.is_alive(), "handle_preemptions returned while the save still read the blocks"
    gate.open()
    preempt.join(30)  # a hang guard
    assert not preempt.is_alive()
    assert manager.keys_with("save_blocks", "stored", WORKER) == vp.keys(vp.vllm_config(), w)
    assert steps.run().finished_sending == {"w"}
    assert steps.run().finished_sending is None


def test_loads_go_before_the_saves_queued_ahead_of_them(manager, connectors):
    gate = manager.hold("save")
    conn, kv = connectors.worker(load_mode="async")
    steps = Steps(conn)
    a, b = vp.request("a", vp.prompt(2, seed=5)), vp.request("b", vp.prompt(2, seed=6))
    steps.run(vp.metadata(saves={"a": [(0, vp.digests(a), [1, 2])]}))
    gate.wait_entered()
    # While a's save runs: b's save, then a load of a's blocks (a request waits for it).
    steps.run(vp.metadata(saves={"b": [(0, vp.digests(b), [3, 4])]}))
    steps.run(vp.metadata(loads={"l": [(0, vp.digests(a), [5, 6])]}))
    gate.open()
    steps.saved("a", "b")
    out = steps.until_received()
    assert out.invalid_block_ids == set()
    order = [(c.op, c.blocks) for c in manager.calls if c.op in ("save_blocks", "load_blocks")]
    assert order == [("save_blocks", (1, 2)), ("load_blocks", (5, 6)), ("save_blocks", (3, 4))]
    steps.run(finished={"a", "b"})


def test_saves_the_manager_refuses_are_counted_and_logged_once(manager, connectors, log):
    """A full Manager (no_space): the blocks are not cached, the request goes on."""
    conn, kv = connectors.worker()
    steps = Steps(conn)
    manager.refuse_saves("no_space")
    for seed, rid in enumerate(("f", "g")):
        steps.run(vp.metadata(saves={rid: [(0, vp.digests(vp.request(rid, vp.prompt(2, seed=7 + seed))), [1, 2])]}))
        steps.saved(rid)
    assert manager.keys_with("save_blocks", "no_space", WORKER) and not manager.chunks
    assert (steps.stats["save_refused_blocks"], steps.stats["saved_blocks"]) == (4, 0)
    assert len(log.messages("refused")) == 1, log.messages("refused")
    assert steps.run(finished={"f", "g"}).finished_sending == {"f", "g"}
    manager.refuse_saves(None)
    h = vp.request("h", vp.prompt(2, seed=9))
    steps.run(vp.metadata(saves={"h": [(0, vp.digests(h), [1, 2])]}))
    steps.saved("h")
    assert steps.stats["saved_blocks"] == 2
    steps.run(finished={"h"})


def test_a_block_saved_twice_is_stored_once(manager, connectors):
    conn, kv = connectors.worker()
    steps = Steps(conn)
    cfg = vp.vllm_config()
    r = vp.request("t", vp.prompt(2, seed=10))
    steps.run(vp.metadata(saves={"t": [(0, vp.digests(r), [1, 2])]}))
    steps.saved("t")
    first = {k: manager.chunks[k] for k in vp.keys(cfg, r)}
    for t in kv.values():
        t[3:5] = 7.0
    # Another request with the same prefix computes it into other blocks.
    steps.run(vp.metadata(saves={"t2": [(0, vp.digests(r), [3, 4])]}))
    steps.saved("t2")
    assert manager.recorded("save_blocks", WORKER)[-1].outcomes == ("already_present",) * 2
    assert {k: manager.chunks[k] for k in first} == first, "not written again"
    assert steps.stats["saved_blocks"] == 2 and steps.stats["save_refused_blocks"] == 0
    steps.run(finished={"t", "t2"})


def test_a_tp_rank_saves_and_loads_in_its_own_namespace(manager, connectors, monkeypatch):
    monkeypatch.setattr("orbitkv.vllm.worker._tp_rank", lambda: 1)
    conn, kv = connectors.worker(tp=2, load_mode="async")
    steps = Steps(conn)
    cfg = vp.vllm_config(tp=2)
    r = vp.request("k", vp.prompt(2, seed=11))
    steps.run(vp.metadata(saves={"k": [(0, vp.digests(r), [1, 2])]}))
    steps.saved("k")
    assert manager.keys_with("save_blocks", "stored", "vllm-worker-1") == vp.keys(cfg, r, rank=1)
    vp.store(manager, cfg, r, 2, rank=0, size=CHUNK)  # rank 0's chunks are not rank 1's
    out = steps.until_received(vp.metadata(loads={"l": [(0, vp.digests(r), [5, 6])]}))
    assert out.invalid_block_ids == set()
    assert manager.recorded("load_blocks", "vllm-worker-1")[0].keys == tuple(vp.keys(cfg, r, rank=1))
    steps.run(finished={"k"})


def test_a_manager_that_is_down_fails_loads_drops_saves_and_is_counted_then_serves(manager, connectors, log):
    manager.stop()
    conn, kv = connectors.worker(load_mode="async")
    steps = Steps(conn)
    cfg = vp.vllm_config()
    r = vp.request("a", vp.prompt(3, seed=12))
    d = vp.digests(r)
    steps.run(vp.metadata(saves={"a": [(0, d, [1, 2, 3])]}))
    steps.saved("a")
    assert steps.run(finished={"a"}).finished_sending == {"a"}, "vLLM gets the blocks back"
    out = steps.until_received(vp.metadata(loads={"l": [(0, d, [5, 6, 7])]}))
    assert out.invalid_block_ids == {5, 6, 7}, "vLLM recomputes them"
    assert manager.recorded("save_blocks") == [] and manager.recorded("load_blocks") == []
    # Registering the namespace, the save and the load, each a miss counted once.
    assert (steps.stats["unavailable"], steps.stats["saved_blocks"], steps.stats["load_error_blocks"]) == (3, 0, 3)
    assert len(log.messages("OrbitKV Manager unavailable")) == 1
    manager.start()
    steps.run(vp.metadata(saves={"b": [(0, d, [1, 2, 3])]}))
    steps.saved("b")
    assert manager.keys_with("save_blocks", "stored", WORKER) == vp.keys(cfg, r)
    out = steps.until_received(vp.metadata(loads={"l2": [(0, d, [5, 6, 7])]}))
    assert out.invalid_block_ids == set()
    assert len(log.messages("OrbitKV Manager reachable again")) == 1
    steps.run(finished={"b"})
