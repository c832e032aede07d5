"""The connector's scheduler and worker sides driven through vLLM's call sequences against a
real Manager, asserting what they report: new request, partial and full hits, a TP group's
common prefix, preemption, abort during a load, a request finished while its saves run, a load
error per block, and a Manager that is down."""

from __future__ import annotations

import os
import signal
import types

import pytest

pytest.importorskip("vllm") if not os.environ.get("ORBITKV_REQUIRE_VLLM") else __import__("vllm")
torch = pytest.importorskip("torch")

import orbitkv  # noqa: E402
from conftest import Server, wait_until  # noqa: E402
from orbitkv.vllm.config import ConfigError, check_hashing, namespace  # noqa: E402
from orbitkv.vllm.scheduler import SchedulerSide  # noqa: E402
from orbitkv.vllm.worker import WorkerSide  # noqa: E402

BS = 32


def vllm_config(tp: int = 1, algo: str = "sha256"):
    mc = types.SimpleNamespace(
        model="tiny", served_model_name="tiny", dtype=torch.float32, use_mla=False,
        get_num_layers=lambda pc: 2, get_num_kv_heads=lambda pc: 1, get_head_size=lambda: 16,
    )
    return types.SimpleNamespace(
        model_config=mc,
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp),
        cache_config=types.SimpleNamespace(block_size=BS, cache_dtype="auto", kv_cache_layout="LBHNC",
                                           prefix_caching_hash_algo=algo),
        device_config=types.SimpleNamespace(device_type="cpu"),
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config={}),
    )


def request(rid: str, n_blocks: int, computed: int = 0, seed: int = 0):
    hashes = [bytes([seed, i]) * 16 for i in range(n_blocks)]
    return types.SimpleNamespace(request_id=rid, block_hashes=hashes, num_computed_tokens=computed)


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def store(server, cfg, req, n, rank=0):
    """Puts the first n blocks of `req` as rank `rank` would have saved them."""
    c = orbitkv.Client(server.socket)
    d = namespace(cfg, rank, "LBHNC")
    c.register_namespace(d)
    keys = [orbitkv.ChunkKey(d.id, orbitkv.chunk_digest(h)) for h in req.block_hashes[:n]]
    assert set(c.put([(k, bytes([i]) * 4096) for i, k in enumerate(keys)])) <= {"stored", "already_present"}


def side(server, tp=1, socket=None):
    cfg = vllm_config(tp)
    # A generous wait: these tests check what a lookup answers, not when. Async loads, as GPU
    # caches have them (the sync ones, a CPU cache's default, have their own test).
    s = SchedulerSide(cfg, {"socket": socket or server.socket, "lookup_wait": 10.0, "load_mode": "async"})
    return cfg, s


def test_new_request_partial_and_full_hits(server):
    cfg, s = side(server)
    miss = request("a", 4)
    assert s.get_num_new_matched_tokens(miss, 0) == (0, False)
    r = request("b", 4, seed=1)
    store(server, cfg, r, 2)
    # Partial: 2 of 4 blocks, as an async load; the leases hold them.
    assert s.get_num_new_matched_tokens(r, 0) == (2 * BS, True)
    assert server.shard_sum("leases") == 2
    s.update_state_after_alloc(r, Blocks([10, 11, 12, 13]), 2 * BS)
    loads, saves, _, _ = s.build_step(types.SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids=set()))
    assert list(loads) == ["b"] and loads["b"][0][2] == [10, 11]
    assert loads["b"] == [(0, [orbitkv.chunk_digest(h) for h in r.block_hashes[:2]], [10, 11])]
    s.update_connector_output(types.SimpleNamespace(finished_recving={"b"}, finished_sending=None))
    s.flush()
    assert server.shard_sum("leases") == 0, "released once the load ended"
    # Full hit: all blocks; a local prefix hit of 1 block is not loaded again.
    store(server, cfg, r, 4)
    r2 = request("c", 4, seed=1)
    assert s.get_num_new_matched_tokens(r2, BS) == (3 * BS, True)
    s.flush()
    assert server.shard_sum("leases") == 3
    # The scheduler took none of it (a local tail won): the leases go at once.
    s.update_state_after_alloc(r2, Blocks([1, 2, 3, 4]), 0)
    s.flush()
    assert server.shard_sum("leases") == 0
    st = s.stats.totals()
    assert (st["lookups"], st["hit_blocks"]) == (3, 5)


def test_a_tp_group_reports_the_prefix_every_rank_has(server):
    cfg, s = side(server, tp=2)
    r = request("t", 4, seed=2)
    store(server, cfg, r, 3, rank=0)
    store(server, cfg, r, 2, rank=1)
    assert s.get_num_new_matched_tokens(r, 0) == (2 * BS, True)
    s.flush()
    assert server.shard_sum("leases") == 4, "two blocks leased for each rank, no more"
    # The engine's own prefix cache already has 3 blocks, past what the group has: nothing to
    # load, and every lease (rank 0 held 3) goes back exactly once.
    r2 = request("t2", 4, seed=2)
    assert s.get_num_new_matched_tokens(r2, 3 * BS) == (0, False)
    s.flush()
    assert server.shard_sum("leases") == 4 and s.manager.client.deferred_failures == 0


def test_preemption_abort_during_load_and_finish_during_save(server):
    cfg, s = side(server)
    r = request("p", 3, seed=3)
    store(server, cfg, r, 3)
    assert s.get_num_new_matched_tokens(r, 0) == (3 * BS, True)
    # Preempted before its load was scheduled and asked again: the old leases go first.
    assert s.get_num_new_matched_tokens(r, 0) == (3 * BS, True)
    s.flush()
    assert server.shard_sum("leases") == 3
    s.update_state_after_alloc(r, Blocks([5, 6, 7]), 3 * BS)
    s.build_step(types.SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids=set()))
    # Aborted while loading: blocks are vLLM's to hold until the load reports; leases stay.
    assert s.request_finished(r) is False
    assert server.shard_sum("leases") == 3
    s.update_connector_output(types.SimpleNamespace(finished_recving={"p"}, finished_sending=None))
    s.flush()
    assert server.shard_sum("leases") == 0 and "p" not in s.reqs

    # A request that computes its blocks: saves planned as blocks fill, then it finishes
    # while they run: its blocks stay until the workers report them saved.
    w = request("w", 3, seed=4)
    assert s.get_num_new_matched_tokens(w, 0) == (0, False)
    s.update_state_after_alloc(w, Blocks([20, 21, 22]), 0)
    s.block_ids_of = lambda rid: ([20, 21, 22],)
    step = types.SimpleNamespace(num_scheduled_tokens={"w": 2 * BS + 5}, preempted_req_ids=set())
    _, saves, _, _ = s.build_step(step)
    assert saves["w"] == [(0, [orbitkv.chunk_digest(h) for h in w.block_hashes[:2]], [20, 21])]
    w.num_computed_tokens = 2 * BS + 5
    _, saves, _, _ = s.build_step(types.SimpleNamespace(num_scheduled_tokens={"w": BS}, preempted_req_ids={"x"}))
    assert saves["w"][0][2] == [22]
    assert s.request_finished(w) is True
    s.update_connector_output(types.SimpleNamespace(finished_recving=None, finished_sending={"w"}))
    assert "w" not in s.reqs


def test_a_manager_that_is_down_makes_misses_and_is_counted(server, tmp_path):
    cfg, s = side(server, socket=str(tmp_path / "nobody.sock"))
    for i in range(50):
        assert s.get_num_new_matched_tokens(request(f"d{i}", 4), 0) == (0, False)
    st = s.stats.totals()
    # 50 lookups and the namespaces' registration, each failing fast as unavailable.
    assert st["unavailable"] == 51 and st["miss_blocks"] == 200
    assert s.manager.client.connect_attempts < 10, "reconnects back off"


def test_a_stopped_manager_never_stalls_the_scheduler(server):
    """A Manager that does not answer (stopped: SIGSTOP) costs the scheduler a step's wait, not
    its request timeout: the lookup is asked again next step (None), then given up as a miss;
    its leases go back once the Manager answers again, and lookups hit again."""
    cfg = vllm_config()
    s = SchedulerSide(cfg, {"socket": server.socket, "lookup_wait": 0.01, "lookup_timeout": 0.3})
    r = request("s", 4, seed=5)
    store(server, cfg, r, 4)
    answers = []
    wait_until("an answer", lambda: answers.append(s.get_num_new_matched_tokens(r, 0)) or answers[-1][0] is not None)
    assert answers[-1] == (4 * BS, False), "answered while the Manager runs"
    s.request_finished(r)
    s.flush()
    server.proc.send_signal(signal.SIGSTOP)
    try:
        late = request("t", 4, seed=5)
        assert s.get_num_new_matched_tokens(late, 0) == (None, False), "asked again next step"
        wait_until("the lookup's deadline", lambda: s.get_num_new_matched_tokens(late, 0) != (None, False), 5)
        assert s.get_num_new_matched_tokens(late, 0) == (None, False), "a new lookup, asked again"
        assert s.stats.totals()["unavailable"] >= 1
    finally:
        server.proc.send_signal(signal.SIGCONT)
    # Given up: a miss; the Manager back, its lookup's leases are returned and lookups hit.
    s.request_finished(late)
    s.flush(timeout=30)
    wait_until("the abandoned lookups' leases returned", lambda: server.shard_sum("leases") == 0, 30)
    again = request("u", 4, seed=5)
    wait_until("a hit again", lambda: s.get_num_new_matched_tokens(again, 0) == (4 * BS, False), 30)


def test_bad_durations_are_refused_naming_the_key(server):
    cfg = vllm_config()
    for key, value in (("lookup_timeout", "soon"), ("lookup_timeout", 0), ("lookup_wait", -1),
                       ("request_timeout", float("nan"))):
        with pytest.raises(ConfigError, match=f"kv_connector_extra_config {key}="):
            SchedulerSide(cfg, {"socket": server.socket, key: value})
    assert SchedulerSide(cfg, {"socket": server.socket, "lookup_wait": 0}).lookup_wait == 0


def test_an_unstable_hash_setting_is_refused_naming_it(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ConfigError, match="prefix_caching_hash_algo='xxhash'"):
        check_hashing(vllm_config(algo="xxhash"))
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    check_hashing(vllm_config(algo="xxhash"))
    check_hashing(vllm_config(algo="sha256_cbor"))


def test_sync_loads_are_reported_in_their_step_and_their_leases_held_past_it(server):
    """A CPU KV cache's default: the hit is a load done in the step that schedules the request
    (not async); its leases are kept until every step that may run it has ended."""
    cfg = vllm_config()
    s = SchedulerSide(cfg, {"socket": server.socket, "lookup_wait": 10.0})
    assert s.sync_loads
    r = request("y", 4, seed=9)
    store(server, cfg, r, 3)
    assert s.get_num_new_matched_tokens(r, 0) == (3 * BS, False)
    s.update_state_after_alloc(r, Blocks([40, 41, 42, 43]), 3 * BS)
    no_work = types.SimpleNamespace(num_scheduled_tokens={}, preempted_req_ids=set())
    loads, _, _, _ = s.build_step(no_work)
    assert loads["y"][0][2] == [40, 41, 42]
    s.flush()
    assert server.shard_sum("leases") == 3, "held while the step that loads may run"
    s.build_step(no_work)
    s.flush()
    assert server.shard_sum("leases") == 3, "and the one after it (one batch in flight)"
    s.build_step(no_work)
    s.flush()
    assert server.shard_sum("leases") == 0, "then given back"
    # No finished_recving follows a sync load: the request finishes as any other.
    assert s.request_finished(r) is False and "y" not in s.reqs
    # A prompt of exactly 3 blocks, all of them stored: the step must still compute its last
    # token, so the hit stops a block short.
    whole = request("x", 3, seed=9)
    whole.num_tokens = 3 * BS
    assert s.get_num_new_matched_tokens(whole, 0) == (2 * BS, False)
    s.request_finished(whole)
    with pytest.raises(ConfigError, match="load_mode='later'"):
        SchedulerSide(cfg, {"socket": server.socket, "load_mode": "later"})


def test_worker_sync_loads_land_before_the_step_and_report_errors_in_it(server, monkeypatch):
    monkeypatch.setattr("orbitkv.vllm.worker._tp_rank", lambda: 0)
    cfg = vllm_config()
    w = WorkerSide(cfg, {"socket": server.socket})
    assert w.sync_loads
    g = torch.Generator().manual_seed(1)
    kv = {f"layer.{i}": torch.randn(8, 1, BS, 32, generator=g) for i in range(2)}
    w.register_kv_caches(kv)
    r = request("z", 3, seed=6)
    digests = [orbitkv.chunk_digest(h) for h in r.block_hashes]
    w.start_saves({"z": [(0, digests[:2], [1, 2])]})
    w.wait_for(["z"])
    before = {k: v.clone() for k, v in kv.items()}
    # Blocks 1-2 saved, block 3 never was: it fails, in this step's errors.
    w.start_loads({"l": [(0, digests, [5, 6, 7])]})
    for k in kv:
        assert torch.equal(kv[k][5], before[k][1]) and torch.equal(kv[k][6], before[k][2])
    # The load is no transfer to report; the save's request has not finished.
    assert w.get_finished(set()) == (None, None)
    assert w.take_load_errors() == {7}
    assert w.take_load_errors() == set()
    w.shutdown()


def test_a_full_manager_refuses_saves_counted_and_logged_once(monkeypatch, caplog):
    """Every chunk of the Manager's DRAM leased (nothing can be evicted): saves are refused,
    the request goes on, the blocks are counted and the reason logged once."""
    monkeypatch.setattr("orbitkv.vllm.worker._tp_rank", lambda: 0)
    full = Server(["--shards", "1", "--dram", "64KiB"])
    try:
        cfg = vllm_config()
        c = orbitkv.Client(full.socket)
        d = namespace(cfg, 0, "LBHNC")
        c.register_namespace(d)
        # Eight 8 KiB chunks fill the 64 KiB arena; leased, none can be evicted.
        keys = [orbitkv.ChunkKey(d.id, bytes([7, i]) * 16) for i in range(8)]
        assert c.put([(k, bytes([i]) * 8192) for i, k in enumerate(keys)]) == ["stored"] * 8
        held = c.lookup_leased(keys)
        assert len(held) == 8
        w = WorkerSide(cfg, {"socket": full.socket})
        kv = {f"layer.{i}": torch.zeros(8, 1, BS, 32) for i in range(2)}
        w.register_kv_caches(kv)
        for n, rid in enumerate(("f", "g")):
            digests = [orbitkv.chunk_digest(bytes([9, n, i]) * 8) for i in range(2)]
            w.start_saves({rid: [(0, digests, [1, 2])]})
            w.wait_for([rid])
        t = w.stats.totals()
        assert (t["save_refused_blocks"], t["saved_blocks"]) == (4, 0), t
        refusals = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 1, [r.getMessage() for r in refusals]
        w.shutdown()
        c.release(held)
    finally:
        full.stop()


def test_worker_loads_saves_and_reports_load_errors_per_block(server, monkeypatch):
    monkeypatch.setattr("orbitkv.vllm.worker._tp_rank", lambda: 0)
    cfg = vllm_config()
    w = WorkerSide(cfg, {"socket": server.socket, "load_mode": "async"})
    g = torch.Generator().manual_seed(0)
    kv = {f"layer.{i}": torch.randn(8, 1, BS, 32, generator=g) for i in range(2)}
    w.register_kv_caches(kv)
    r = request("s", 3, seed=5)
    digests = [orbitkv.chunk_digest(h) for h in r.block_hashes]
    w.start_saves({"s": [(0, digests, [1, 2, 3])]})
    w.wait_for(["s"])
    assert w.get_finished({"s"}) == ({"s"}, None)
    # Corrupt the second chunk: another length under its key.
    c = orbitkv.Client(server.socket)
    c.register_namespace(namespace(cfg, 0, "LBHNC"))  # a session names only namespaces it registered
    key = orbitkv.ChunkKey(w.ns_ids[0], digests[1])
    assert c.evict([key]) == ["done"] and c.put([(key, b"x" * 10)]) == ["stored"]
    before = {k: v.clone() for k, v in kv.items()}
    w.start_loads({"l": [(0, digests, [5, 6, 7])]})
    for _ in range(1000):
        sending, recving = w.get_finished(set())
        if recving:
            break
        import time

        time.sleep(0.005)
    assert recving == {"l"}
    assert w.take_load_errors() == {6, 7}
    for k in kv:
        assert torch.equal(kv[k][5], before[k][1]), "block 1 loaded into block 5"
        assert torch.equal(kv[k][6], before[k][6]) and torch.equal(kv[k][7], before[k][7])
    assert w.take_load_errors() == set()
    t = w.stats.totals()
    assert (t["saved_blocks"], t["loaded_blocks"], t["load_error_blocks"]) == (3, 1, 2)
    w.shutdown()
