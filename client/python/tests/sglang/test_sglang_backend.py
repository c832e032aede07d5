"""`orbitkv.sglang.OrbitKVStorage` driven the way SGLang 0.5.23's cache controller drives it,
against a real Manager: created by SGLang's own `StorageBackendFactory` ("dynamic"), given
SGLang's own host pools (`MHATokenToKVPoolHost`, `MLATokenToKVPoolHost`, built on the CPU in
every layout they offer), then `batch_exists` / `batch_get_v1` / `batch_set_v1` with host
indices as the controller passes them, and the older flat-page interface. Keys are chained
SHA-256 page hashes in SGLang's form (64 hex digits)."""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
import types

import pytest

if os.environ.get("ORBITKV_REQUIRE_SGLANG"):
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
else:
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
torch = pytest.importorskip("torch")

import orbitkv  # noqa: E402
import sglang_pools  # noqa: E402
from orbitkv.sglang import OrbitKVStorage  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

L, H, D, P, TOKENS = 3, 2, 16, 4, 64
LORA, ROPE = 8, 4
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def host_pool(layout: str, mla: bool = False, seed: int = 0):
    """SGLang's host pool of a 3-layer model (page size 4) on the CPU."""
    return sglang_pools.host_pool(layout, mla, layers=L, heads=H, head_dim=D, page=P, tokens=TOKENS, lora=LORA,
                                  rope=ROPE, seed=seed)


def page_keys(n: int, seed: int = 0):
    """Chained page hashes as SGLang makes them: SHA-256 of the previous page's digest and the
    page's token ids (little-endian u32)."""
    keys, prev = [], b""
    for p in range(n):
        tokens = [(seed * 7919 + p * P + t) % 32000 for t in range(P)]
        prev = hashlib.sha256(prev + struct.pack(f"<{P}I", *tokens)).digest()
        keys.append(prev.hex())
    return keys


def indices(pages):
    """Host indices as the controller passes them: every token slot of each page."""
    return torch.tensor([p * P + t for p in pages for t in range(P)], dtype=torch.int64)


def config(server, mla=False, tp_rank=0, tp_size=1, **extra):
    ex = {"backend_name": "orbitkv", "module_path": "orbitkv.sglang", "class_name": "OrbitKVStorage",
          "interface_v1": 1, "socket": server.socket if server else "/tmp/okv-nowhere/s.sock", **extra}
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name="tiny-sglang", extra_config=ex)


def backend(cfg, pool):
    """Created and attached as SGLang's cache controller does."""
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    b.on_host_pools_registered()
    return b


def same_pages(a, a_pages, b, b_pages) -> bool:
    return all(torch.equal(a.get_data_page(x * P), b.get_data_page(y * P)) for x, y in zip(a_pages, b_pages))


@pytest.mark.parametrize("mla,layout", [(False, x) for x in MHA_LAYOUTS] + [(True, x) for x in MLA_LAYOUTS])
def test_pages_round_trip_through_the_v1_interface(server, mla, layout):
    src, dst = host_pool(layout, mla, seed=3), host_pool(layout, mla)
    a, b = backend(config(server, mla), src), backend(config(server, mla), dst)
    assert isinstance(a, OrbitKVStorage) and isinstance(a, HiCacheStorage)
    keys = page_keys(5, seed=1)
    assert a.batch_set_v1(keys[:3], indices([3, 4, 5])) == [True] * 3
    assert a.batch_set_v1(keys[:1], indices([3])) == [True]  # already there
    # A partial prefix: three of five pages, leased until read.
    assert b.batch_exists(keys) == 3
    assert server.shard_sum("leases") == 3
    assert b.batch_get_v1(keys, indices([7, 8, 9, 10, 11])) == [True, True, True, False, False]
    assert same_pages(dst, [7, 8, 9], src, [3, 4, 5])
    assert not dst.get_data_page(10 * P).any()
    b.client.flush()
    assert server.shard_sum("leases") == 0
    stats = a.get_stats()
    assert stats.backup_pgs == [3, 1] and len(stats.backup_bandwidth) == 2
    assert b.get_stats().prefetch_pgs == [3] and b.get_stats().prefetch_pgs == []


@pytest.mark.parametrize("mla,layout", [(False, "page_first"), (False, "layer_first"), (True, "page_first")])
def test_flat_pages_and_v1_pages_are_the_same_chunks(server, mla, layout):
    src, dst = host_pool(layout, mla, seed=4), host_pool(layout, mla)
    a, b = backend(config(server, mla), src), backend(config(server, mla), dst)
    keys = page_keys(4, seed=2)
    # Stored by the older interface (SGLang's flat data pages) ...
    assert a.batch_set(keys[:2], [src.get_data_page(p * P) for p in (1, 2)])
    assert a.set(keys[2], src.get_data_page(5 * P))
    assert a.exists(keys[2]) and not a.exists(keys[3])
    # ... read by v1 into the pool; and stored by v1, read as flat pages.
    assert b.batch_get_v1(keys[:3], indices([0, 1, 2])) == [True] * 3
    assert same_pages(dst, [0, 1, 2], src, [1, 2, 5])
    assert a.batch_set_v1(keys[3:], indices([6])) == [True]
    pages = b.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
    assert all(p is not None for p in pages)
    assert torch.equal(pages[3], src.get_data_page(6 * P))
    assert b.get(page_keys(1, seed=99)[0], dst.get_dummy_flat_data_page()) is None


def test_tp_ranks_have_their_own_pages_but_mla_ranks_share(server):
    keys = page_keys(2, seed=5)
    for mla, shared in ((False, False), (True, True)):
        r0 = backend(config(server, mla, tp_rank=0, tp_size=2), host_pool("page_first", mla, seed=6))
        r1 = backend(config(server, mla, tp_rank=1, tp_size=2), host_pool("page_first", mla))
        assert r0.batch_set_v1(keys, indices([0, 1])) == [True, True]
        assert r1.batch_exists(keys) == (2 if shared else 0)
        r1.clear()


def test_leases_of_pages_never_read_end(server):
    b = backend(config(server, lease_seconds=0), host_pool("page_first", seed=7))
    keys = page_keys(3, seed=8)
    assert b.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    assert b.batch_exists(keys) == 3
    # Another rank had fewer: SGLang reads one page; the other two leases end at the next call.
    assert b.batch_get_v1(keys[:1], indices([5])) == [True]
    assert b.batch_exists(page_keys(1, seed=77)) == 0
    b.client.flush()
    assert server.shard_sum("leases") == 0
    capped = backend(config(server, max_held_leases=2), host_pool("page_first"))
    assert capped.batch_exists(keys) == 3
    capped.batch_exists(page_keys(1, seed=78))
    capped.client.flush()
    assert server.shard_sum("leases") == 2
    capped.close()
    assert server.shard_sum("leases") == 0


def test_a_manager_down_or_restarting_makes_misses_logged_once(server, caplog):
    caplog.set_level(logging.WARNING, logger="orbitkv.sglang")
    pool = host_pool("page_first", seed=9)
    gone = backend(config(None), pool)
    keys = page_keys(2, seed=10)
    for _ in range(3):
        assert gone.batch_exists(keys) == 0
        assert gone.batch_set_v1(keys, indices([0, 1])) == [False, False]
        assert gone.batch_get_v1(keys, indices([0, 1])) == [False, False]
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1

    b = backend(config(server), pool)
    assert b.batch_set_v1(keys, indices([0, 1])) == [True, True]
    server.restart()
    results = [b.batch_exists(keys) for _ in range(200)]
    assert results[0] == 0  # the restarted Manager is empty: a miss, never an exception
    assert b.batch_set_v1(keys, indices([0, 1])) in ([True, True], [False, False])
    deadline = time.monotonic() + 10
    while b.batch_set_v1(keys, indices([0, 1])) != [True, True]:
        assert time.monotonic() < deadline, "no reconnect"
        time.sleep(0.05)
    assert b.batch_exists(keys) == 2


def test_bad_input_is_refused_naming_what_is_wrong(server):
    odd = types.SimpleNamespace(layout="page_unified", kv_buffer=torch.zeros(4), page_size=P, size=TOKENS)
    with pytest.raises(ValueError, match="page_unified"):
        OrbitKVStorage(config(server), {}).register_mem_pool_host(odd)
    b = backend(config(server), host_pool("page_first"))
    with pytest.raises(ValueError, match="does not start a page"):
        b.batch_set_v1(page_keys(1), torch.arange(1, 1 + P))
    with pytest.raises(ValueError, match="host indices for 2 pages"):
        b.batch_get_v1(page_keys(2), indices([0]))
    cfg = config(server)
    cfg.should_split_heads = True
    with pytest.raises(ValueError, match="split heads"):
        OrbitKVStorage(cfg, {})
    assert b.batch_exists(page_keys(1, seed=123)) == 0  # still serving


def test_a_vllm_engine_and_an_sglang_engine_keep_to_their_namespaces(server):
    """The same digest under the vLLM connector's namespace and SGLang's: neither sees the
    other's page."""
    pytest.importorskip("vllm.logger")  # not the tests' own vllm/ folder
    from orbitkv.vllm.config import namespace

    mc = types.SimpleNamespace(model="tiny", served_model_name="tiny", dtype=torch.bfloat16, use_mla=False,
                               get_num_layers=lambda pc: L, get_num_kv_heads=lambda pc: H, get_head_size=lambda: D)
    vllm_config = types.SimpleNamespace(
        model_config=mc, parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
        cache_config=types.SimpleNamespace(block_size=P, cache_dtype="auto", kv_cache_layout="LBHNC"),
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config={}))
    b = backend(config(server), host_pool("page_first", seed=11))
    key = page_keys(1, seed=12)
    assert b.batch_set_v1(key, indices([2])) == [True]
    c = orbitkv.Client(server.socket)
    ns = c.register_namespace(namespace(vllm_config, 0, "LBHNC"))
    digest = orbitkv.chunk_digest(bytes.fromhex(key[0]))
    assert c.lookup([orbitkv.ChunkKey(ns.id, digest)]) == []
    assert c.put([(orbitkv.ChunkKey(ns.id, orbitkv.chunk_digest(b"v" * 32)), b"x" * 64)]) == ["stored"]
    assert b.batch_exists(["76" * 32]) == 0
    assert b.batch_exists(key) == 1


def test_leases_held_across_a_manager_restart_do_not_sink_the_new_sessions(server):
    """Leases batch_exists took before a restart went with their session: giving back the new
    session's leases together with them must still give the new ones back."""
    b = backend(config(server), host_pool("page_first", seed=13))
    old, new = page_keys(2, seed=14), page_keys(2, seed=15)
    assert b.batch_set_v1(old, indices([0, 1])) == [True, True]
    assert b.batch_exists(old) == 2  # held, never read
    server.restart()
    deadline = time.monotonic() + 10
    while b.batch_set_v1(new, indices([2, 3])) != [True, True]:
        assert time.monotonic() < deadline, "no reconnect"
        time.sleep(0.05)
    assert b.batch_exists(new) == 2  # held beside the old session's
    b.clear()  # gives back everything held
    b.client.flush()
    assert server.shard_sum("leases") == 0


@pytest.mark.parametrize("checksums", [True, False])
def test_large_batches_round_trip_on_several_threads(server, checksums):
    """Batches past the client's 8 MiB streamed-copy size, split over copy threads: byte-exact
    both ways, whether pages are hashed as they are copied (the default) or by the Manager's
    shards at commit (`client_checksums` false); the shards check the first page's checksum of
    every commit, so a wrong one would fail the set."""
    pages, page = 40, 16  # 256 KiB pages, 10 MiB a batch
    mk = dict(layers=8, heads=4, head_dim=128, page=page, tokens=pages * page)
    src = sglang_pools.host_pool("page_first", **mk, seed=21)
    dst = sglang_pools.host_pool("page_first", **mk)
    extra = {"copy_threads": 3, "client_checksums": checksums}
    a, b = backend(config(server, **extra), src), backend(config(server, **extra), dst)
    assert src.get_data_page(0).nbytes * pages >= 8 << 20
    keys = page_keys(pages, seed=22 + checksums)
    slots = torch.arange(pages * page, dtype=torch.int64)
    assert a.batch_set_v1(keys, slots) == [True] * pages
    assert b.batch_exists(keys) == pages
    assert b.batch_get_v1(keys, slots) == [True] * pages
    assert all(torch.equal(dst.get_data_page(p * page), src.get_data_page(p * page)) for p in range(pages))
