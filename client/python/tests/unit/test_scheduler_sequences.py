"""The connector's scheduler side driven through vLLM's call sequences against a fake Manager
(`fake_native`, no orbitkv-server): new request, partial and full hits, a TP group's common
prefix, sync loads, preemption, abort during a load, a request finished while its saves run, a
failed load, a lookup the Manager does not answer, and a Manager that is down, restarts and comes
back. Each asserts what the connector reports to vLLM and what the Manager saw: the keys looked
up, every lease released exactly once, nothing left pending."""

from __future__ import annotations

import os
import types

import pytest

pytest.importorskip("vllm.logger") if not os.environ.get("ORBITKV_REQUIRE_VLLM") else __import__("vllm.logger")
torch = pytest.importorskip("torch")

import fake_native  # noqa: E402
import vllm_parts as vp  # noqa: E402
from orbitkv.vllm import OrbitKVConnectorMetadata  # noqa: E402
from vllm_parts import BS, connectors, log  # noqa: E402, F401 (fixtures, passed by name)

SCHEDULER = "vllm-scheduler"


@pytest.fixture
def manager(monkeypatch):
    return fake_native.install(monkeypatch)


def stats(conn):
    """The counters vLLM takes this step (zero where the connector reported none)."""
    taken = conn.get_kv_connector_stats()
    return {} if taken is None else taken.data


def lookups(manager):
    return manager.recorded("lookup_leased", SCHEDULER)


def test_a_new_request_misses_and_holds_nothing(manager, connectors):
    conn = connectors.scheduler()
    cfg = vp.vllm_config()
    r = vp.request("a", vp.prompt(4))
    assert conn.get_num_new_matched_tokens(r, 0) == (0, False)
    # One lookup, of the rank's namespace keys of vLLM's own block hashes.
    assert [c.keys for c in lookups(manager)] == [tuple(vp.keys(cfg, r))]
    conn.update_state_after_alloc(r, vp.blocks([1, 2, 3, 4, 5]), 0)
    meta = conn.build_connector_meta(vp.step())
    assert isinstance(meta, OrbitKVConnectorMetadata)
    assert (meta.loads, meta.saves, meta.preempted) == ({}, {}, [])
    vp.settle(conn)
    assert manager.leases_held() == 0
    st = stats(conn)
    assert (st["lookups"], st["hit_blocks"], st["miss_blocks"], st["unavailable"]) == (1, 0, 4, 0)
    assert conn.get_kv_connector_stats() is None, "the interval's counters were taken"


def test_a_partial_hit_is_an_async_load_whose_leases_last_until_it_ends(manager, connectors):
    conn = connectors.scheduler()
    cfg = vp.vllm_config()
    r = vp.request("b", vp.prompt(4, seed=1))
    vp.store(manager, cfg, r, 2)
    assert conn.get_num_new_matched_tokens(r, 0) == (2 * BS, True)
    assert manager.leases_held() == 2, "the hit's chunks are leased"
    conn.update_state_after_alloc(r, vp.blocks([10, 11, 12, 13]), 2 * BS)
    meta = conn.build_connector_meta(vp.step())
    assert meta.loads == {"b": [(0, vp.digests(r, 2), [10, 11])]} and meta.saves == {}
    # The next step has no new load for it.
    assert conn.build_connector_meta(vp.step()).loads == {}
    vp.settle(conn)
    assert manager.leases_held() == 2, "held while the workers load"
    conn.update_connector_output(vp.output(recving={"b"}))
    vp.settle(conn)
    assert manager.leases_held() == 0, "released once the load ended"
    st = stats(conn)
    assert (st["lookups"], st["hit_blocks"], st["miss_blocks"]) == (1, 2, 2)


def test_a_full_hit_loads_only_what_the_engine_does_not_have(manager, connectors):
    conn = connectors.scheduler()
    cfg = vp.vllm_config()
    r = vp.request("c", vp.prompt(4, seed=2))
    ks = vp.store(manager, cfg, r, 4)
    # vLLM's own prefix cache has the first block: the rest is the hit.
    assert conn.get_num_new_matched_tokens(r, BS) == (3 * BS, True)
    vp.settle(conn)
    assert manager.leases_held() == 3, "the lease of the engine's own block went back at once"
    assert manager.keys_with("release_deferred", "done", SCHEDULER) == ks[:1]
    conn.update_state_after_alloc(r, vp.blocks([7, 8, 9, 10]), 3 * BS)
    meta = conn.build_connector_meta(vp.step())
    assert meta.loads == {"c": [(0, vp.digests(r)[1:], [8, 9, 10])]}
    conn.update_connector_output(vp.output(recving={"c"}))
    # The same prompt again, but vLLM's scheduler takes none of the hit (a local hit won):
    # the leases go at once and nothing is loaded.
    again = vp.request("c2", vp.prompt(4, seed=2))
    assert conn.get_num_new_matched_tokens(again, 0) == (4 * BS, True)
    conn.update_state_after_alloc(again, vp.blocks([1, 2, 3, 4]), 0)
    assert conn.build_connector_meta(vp.step()).loads == {}
    vp.settle(conn)
    assert manager.leases_held() == 0
    st = stats(conn)
    assert (st["lookups"], st["hit_blocks"], st["miss_blocks"]) == (2, 7, 0)


def test_a_tp_group_reports_the_prefix_every_rank_has(manager, connectors):
    conn = connectors.scheduler(tp=2)
    cfg = vp.vllm_config(tp=2)
    r = vp.request("t", vp.prompt(4, seed=3))
    vp.store(manager, cfg, r, 3, rank=0)
    vp.store(manager, cfg, r, 2, rank=1)
    assert conn.get_num_new_matched_tokens(r, 0) == (2 * BS, True)
    vp.settle(conn)
    # Rank 0 is asked for all four blocks, rank 1 only for the three rank 0 has.
    assert [c.keys for c in lookups(manager)] == [tuple(vp.keys(cfg, r, rank=0)), tuple(vp.keys(cfg, r, 3, rank=1))]
    assert manager.leases_held() == 4, "two blocks for each rank, rank 0's third given back"
    # The engine's own prefix cache has 3 blocks, past what the group has: nothing to load,
    # and every lease of that lookup goes back exactly once.
    r2 = vp.request("t2", vp.prompt(4, seed=3))
    assert conn.get_num_new_matched_tokens(r2, 3 * BS) == (0, False)
    vp.settle(conn)
    assert manager.leases_held() == 4
    # The load names digests and blocks only: each worker keys them in its own rank's namespace.
    conn.update_state_after_alloc(r, vp.blocks([4, 5, 6, 7]), 2 * BS)
    assert conn.build_connector_meta(vp.step()).loads == {"t": [(0, vp.digests(r, 2), [4, 5])]}
    conn.update_connector_output(vp.output(recving={"t"}))
    vp.settle(conn)
    assert manager.leases_held() == 0 and manager.client(SCHEDULER).deferred_failures == 0


def test_sync_loads_keep_their_leases_past_the_steps_that_may_run_them(manager, connectors):
    """A CPU KV cache's default: the hit is loaded in the step that schedules the request, so no
    finished_recving follows; its leases stay until every step that may run it has ended."""
    conn = connectors.scheduler(load_mode="auto")
    cfg = vp.vllm_config()
    r = vp.request("y", vp.prompt(4, seed=4))
    vp.store(manager, cfg, r, 3)
    assert conn.get_num_new_matched_tokens(r, 0) == (3 * BS, False)
    conn.update_state_after_alloc(r, vp.blocks([40, 41, 42, 43]), 3 * BS)
    assert conn.build_connector_meta(vp.step()).loads == {"y": [(0, vp.digests(r, 3), [40, 41, 42])]}
    vp.settle(conn)
    assert manager.leases_held() == 3, "held while the step that loads may run"
    conn.build_connector_meta(vp.step())
    vp.settle(conn)
    assert manager.leases_held() == 3, "and the one after it (one batch in flight)"
    conn.build_connector_meta(vp.step())
    vp.settle(conn)
    assert manager.leases_held() == 0, "then given back"
    assert conn.request_finished(r, [40, 41, 42, 43]) == (False, None)
    # A prompt of exactly 3 stored blocks: the step must still compute its last token, so the
    # hit stops a block short (and only those blocks are asked for).
    whole = vp.request("x", vp.prompt(3, seed=4, tail=0))
    assert conn.get_num_new_matched_tokens(whole, 0) == (2 * BS, False)
    assert lookups(manager)[-1].keys == tuple(vp.keys(cfg, whole, 2))
    assert conn.request_finished(whole, []) == (False, None)


def test_a_preempted_request_asked_again_gives_its_old_leases_back(manager, connectors):
    conn = connectors.scheduler()
    cfg = vp.vllm_config()
    r = vp.request("p", vp.prompt(3, seed=5))
    vp.store(manager, cfg, r, 3)
    assert conn.get_num_new_matched_tokens(r, 0) == (3 * BS, True)
    # Not scheduled (no room), asked again next step: a new lookup; the old leases go first.
    assert conn.get_num_new_matched_tokens(r, 0) == (3 * BS, True)
    vp.settle(conn)
    assert len(lookups(manager)) == 2
    assert manager.leases_held() == 3
    # Preempted after it ran: vLLM frees its blocks and it comes back as a new prompt.
    conn.update_state_after_alloc(r, vp.blocks([5, 6, 7]), 3 * BS)
    conn.build_connector_meta(vp.step({"p": 5}))
    conn.update_connector_output(vp.output(recving={"p"}))
    meta = conn.build_connector_meta(vp.step(preempted={"p"}))
    assert meta.preempted == ["p"], "the workers finish its saves before its blocks are reused"
    assert conn.get_num_new_matched_tokens(r, 0) == (3 * BS, True)
    vp.settle(conn)
    assert manager.leases_held() == 3
    assert conn.request_finished(r, []) == (False, None)
    vp.settle(conn)
    assert manager.leases_held() == 0


def test_a_request_aborted_during_its_load_keeps_its_leases_until_the_load_reports(manager, connectors):
    conn = connectors.scheduler()
    cfg = vp.vllm_config()
    r = vp.request("q", vp.prompt(3, seed=6))
    vp.store(manager, cfg, r, 3)
    assert conn.get_num_new_matched_tokens(r, 0) == (3 * BS, True)
    conn.update_state_after_alloc(r, vp.blocks([5, 6, 7]), 3 * BS)
    assert list(conn.build_connector_meta(vp.step()).loads) == ["q"]
    # Aborted while the workers load: vLLM holds its blocks until the load reports (it had no
    # saves of its own, so the connector asks nothing more of them), and the leases stay.
    assert conn.request_finished(r, [5, 6, 7]) == (False, None)
    vp.settle(conn)
    assert manager.leases_held() == 3
    conn.update_connector_output(vp.output(recving={"q"}))
    vp.settle(conn)
    assert manager.leases_held() == 0
    assert "q" not in conn._scheduler.reqs, "the request is forgotten"


def test_a_request_finished_while_its_saves_run_keeps_its_blocks_until_they_are_saved(manager, connectors):
    conn = connectors.scheduler()
    table = {"w": [20, 21, 22, 23]}
    conn.bind_kv_cache_manager(types.SimpleNamespace(block_pool=None, get_block_ids=lambda rid: (table[rid],)))
    w = vp.request("w", vp.prompt(3, seed=7))
    assert conn.get_num_new_matched_tokens(w, 0) == (0, False)
    conn.update_state_after_alloc(w, vp.blocks(table["w"]), 0)
    # Chunked prefill: two blocks and some in this step, saved as they fill...
    meta = conn.build_connector_meta(vp.step({"w": 2 * BS + 5}))
    assert meta.saves == {"w": [(0, vp.digests(w, 2), [20, 21])]} and meta.loads == {}
    w.num_computed_tokens = 2 * BS + 5
    # ...the third in the next; the partial last block never.
    meta = conn.build_connector_meta(vp.step({"w": BS}, preempted={"x"}))
    assert meta.saves == {"w": [(0, vp.digests(w)[2:], [22])]} and meta.preempted == ["x"]
    w.num_computed_tokens = 3 * BS + 5
    assert conn.build_connector_meta(vp.step({"w": 1})).saves == {}
    # Finished while those saves may still run: vLLM must keep its blocks until they report.
    assert conn.request_finished(w, table["w"]) == (True, None)
    assert "w" in conn._scheduler.reqs
    conn.update_connector_output(vp.output(sending={"w"}))
    assert "w" not in conn._scheduler.reqs
    assert manager.recorded("save_blocks") == [], "the scheduler side never saves itself"


def test_a_request_whose_load_failed_is_not_looked_up_again(manager, connectors):
    """vLLM reports a failed load per request (several KV cache groups) and recomputes it: a
    second lookup would offer the same broken hit."""
    conn = connectors.scheduler()
    cfg = vp.vllm_config()
    r = vp.request("f", vp.prompt(2, seed=8))
    vp.store(manager, cfg, r, 2)
    assert conn.get_num_new_matched_tokens(r, 0) == (2 * BS, True)
    conn.update_state_after_alloc(r, vp.blocks([3, 4, 5]), 2 * BS)
    conn.build_connector_meta(vp.step())
    conn.update_connector_output(vp.output(recving={"f"}, failed={"f"}))
    assert conn.get_num_new_matched_tokens(r, 0) == (0, False)
    assert len(lookups(manager)) == 1
    vp.settle(conn)
    assert manager.leases_held() == 0
    assert conn.request_finished(r, [3, 4, 5]) == (False, None)


def test_an_async_load_failed_at_its_first_block_is_not_offered_again(manager, connectors, monkeypatch):
    """vLLM's recompute policy for an async load: blocks from the first failed one are computed
    again; when that is the request's first block, the request goes back to waiting with no
    computed tokens and vLLM asks the connector again. The same hit must not come back."""
    monkeypatch.setattr("orbitkv.vllm.worker._tp_rank", lambda: 0)
    sched = connectors.scheduler()
    worker, _ = connectors.worker(load_mode="async")
    steps = vp.Steps(worker)
    cfg = vp.vllm_config()
    r = vp.request("r", vp.prompt(3, seed=16))
    ks = vp.store(manager, cfg, r, 3)
    manager.store(ks[0], b"x" * 10)  # saved with another layout: its load fails
    assert sched.get_num_new_matched_tokens(r, 0) == (3 * BS, True)
    sched.update_state_after_alloc(r, vp.blocks([1, 2, 3, 4]), 3 * BS)
    out = steps.until_received(sched.build_connector_meta(vp.step()))
    assert out.finished_recving == {"r"} and out.invalid_block_ids == {1, 2, 3}
    sched.update_connector_output(out)
    # vLLM truncates the request at its first failed block (0), frees its blocks and, the
    # request waiting again with nothing computed, asks the connector again.
    r.num_computed_tokens = 0
    again = sched.get_num_new_matched_tokens(r, 0)
    sched.request_finished(r, [])
    assert again == (0, False), "the hit whose load just failed is offered again"


def test_a_decode_instance_never_looks_up(manager, connectors):
    conn = connectors.scheduler(role="decode")
    r = vp.request("d", vp.prompt(4, seed=9))
    vp.store(manager, vp.vllm_config(), r, 4)
    assert conn.get_num_new_matched_tokens(r, 0) == (0, False)
    vp.settle(conn)
    assert lookups(manager) == [] and manager.leases_held() == 0


def test_a_lookup_the_manager_does_not_answer_is_asked_again_then_given_up(manager, connectors, monkeypatch):
    """A Manager that does not answer costs the scheduler no wait (lookup_wait 0): vLLM asks
    again next step (None) until lookup_timeout, then it is a miss counted as unavailable; the
    leases the late lookup takes go back once it ends."""
    now = [1000.0]
    monkeypatch.setattr("orbitkv.vllm.scheduler.time", types.SimpleNamespace(monotonic=lambda: now[0]))
    gate = manager.hold("lookup")
    conn = connectors.scheduler(lookup_wait=0, lookup_timeout=1.0)
    cfg = vp.vllm_config()
    r = vp.request("s", vp.prompt(4, seed=10))
    vp.store(manager, cfg, r, 4)
    assert conn.get_num_new_matched_tokens(r, 0) == (None, False)
    gate.wait_entered()
    now[0] += 0.5
    assert conn.get_num_new_matched_tokens(r, 0) == (None, False), "asked again, not looked up again"
    now[0] += 1.0
    assert conn.get_num_new_matched_tokens(r, 0) == (0, False), "given up: a miss"
    st = stats(conn)
    assert (st["lookups"], st["miss_blocks"], st["unavailable"]) == (1, 4, 1)
    assert conn.request_finished(r, []) == (False, None)
    gate.open()
    vp.settle(conn)
    (late,) = lookups(manager)
    assert late.outcomes == ("done",) * 4, "the late lookup did lease the chunks"
    assert manager.leases_held() == 0, "and they went back"
    # Answered again: a hit (this step, or the next if the answer is late).
    again = vp.request("s2", vp.prompt(4, seed=10))
    answer = conn.get_num_new_matched_tokens(again, 0)
    if answer[0] is None:
        vp.settle(conn)
        answer = conn.get_num_new_matched_tokens(again, 0)
    assert answer == (4 * BS, True)
    assert conn.request_finished(again, []) == (False, None)


def test_a_request_finished_while_its_lookup_is_pending_gives_the_lookups_leases_back(manager, connectors):
    gate = manager.hold("lookup")
    conn = connectors.scheduler(lookup_wait=0)
    cfg = vp.vllm_config()
    r = vp.request("e", vp.prompt(3, seed=11))
    vp.store(manager, cfg, r, 3)
    assert conn.get_num_new_matched_tokens(r, 0) == (None, False)
    gate.wait_entered()
    assert conn.request_finished(r, []) == (False, None)
    assert "e" not in conn._scheduler.reqs
    gate.open()
    vp.settle(conn)
    assert lookups(manager)[0].outcomes == ("done",) * 3
    assert manager.leases_held() == 0


def test_a_manager_that_is_down_makes_misses_counted_and_logged_once_then_hits(manager, connectors, log):
    manager.stop()
    conn = connectors.scheduler()
    cfg = vp.vllm_config()
    for i in range(5):
        assert conn.get_num_new_matched_tokens(vp.request(f"d{i}", vp.prompt(4, seed=12)), 0) == (0, False)
    st = stats(conn)
    # The namespaces' registration and 5 lookups, each failing as unavailable.
    assert (st["unavailable"], st["lookups"], st["miss_blocks"]) == (6, 5, 20)
    assert lookups(manager) == []
    assert len(log.messages("OrbitKV Manager unavailable")) == 1
    # Back: the client registers the namespaces it was given again, and lookups hit.
    manager.start()
    r = vp.request("up", vp.prompt(4, seed=12))
    vp.store(manager, cfg, r, 4)
    assert conn.get_num_new_matched_tokens(r, 0) == (4 * BS, True)
    assert len(log.messages("OrbitKV Manager reachable again")) == 1
    assert stats(conn)["unavailable"] == 0
    assert conn.request_finished(r, []) == (False, None)
    for rid in [f"d{i}" for i in range(5)]:
        conn.request_finished(types.SimpleNamespace(request_id=rid), [])
    vp.settle(conn)
    assert manager.leases_held() == 0


def test_leases_of_a_session_the_manager_ended_are_dropped_quietly(manager, connectors, log):
    """The Manager restarts while a load holds leases: they ended with the session (the
    release is stale, not a failure to count), and the next lookup opens a new session."""
    conn = connectors.scheduler()
    cfg = vp.vllm_config()
    r = vp.request("m", vp.prompt(3, seed=13))
    vp.store(manager, cfg, r, 3)
    assert conn.get_num_new_matched_tokens(r, 0) == (3 * BS, True)
    conn.update_state_after_alloc(r, vp.blocks([1, 2, 3]), 3 * BS)
    conn.build_connector_meta(vp.step())
    manager.stop()
    manager.start()
    conn.update_connector_output(vp.output(recving={"m"}))
    vp.settle(conn)
    assert manager.dropped_leases == 3 and manager.bad_releases == []
    assert log.messages("failed") == [], "a stale release is no failure"
    again = vp.request("m2", vp.prompt(3, seed=13))
    assert conn.get_num_new_matched_tokens(again, 0) == (3 * BS, True)
    assert manager.client(SCHEDULER).connect_attempts == 2, "one session before the restart, one after"
    st = stats(conn)
    assert (st["unavailable"], st["hit_blocks"]) == (0, 6)
    assert conn.request_finished(again, []) == (False, None)


def test_shutdown_gives_back_every_lease(manager, connectors):
    conn = connectors.scheduler()
    cfg = vp.vllm_config()
    for i, rid in enumerate(("h1", "h2")):
        r = vp.request(rid, vp.prompt(2, seed=14 + i))
        vp.store(manager, cfg, r, 2)
        assert conn.get_num_new_matched_tokens(r, 0) == (2 * BS, True)
    r3 = vp.request("h3", vp.prompt(2, seed=14))
    assert conn.get_num_new_matched_tokens(r3, 0) == (2 * BS, True)
    vp.settle(conn)
    assert manager.leases_held() == 6
    connectors.shutdown(conn)
    assert manager.leases_held() == 0 and manager.bad_releases == []
