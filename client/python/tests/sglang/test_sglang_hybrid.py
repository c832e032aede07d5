"""`orbitkv.sglang.OrbitKVStorage` with the host pools of SGLang 0.5.23's hybrid models, driven
as its hybrid cache controller drives them (`register_mem_host_pool_v2`, then
`batch_exists_v2` / `batch_get_v2` / `batch_set_v2` with `PoolTransfer`s), against a real
Manager: a sliding-window model's SWA pool (SGLang's `MHATokenToKVPoolHost` of the SWA
layers, trailing pages) and a Mamba / linear-attention model's state pool (SGLang's
`MambaPoolHost`, its checkpoint slots as flat data pages) round trip between two engines; a
prefix is reported only where every pool holds what its hit policy asks; an object that is no
host pool is refused at attach, naming its class."""

from __future__ import annotations

import os

import pytest

if os.environ.get("ORBITKV_REQUIRE_SGLANG"):
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
else:
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
torch = pytest.importorskip("torch")

import sglang_pools  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: E402
from test_sglang_backend import TOKENS, P, backend, config, host_pool, indices, page_keys, same_pages  # noqa: E402

SWA_LAYERS = 2


def swa_pool(seed: int = 0):
    """The SWA pool SGLang builds beside the full-attention one: a token KV host pool of the
    sliding-window layers, same page size."""
    return sglang_pools.host_pool("page_first", False, layers=SWA_LAYERS, heads=2, head_dim=16, page=P,
                                  tokens=TOKENS, seed=seed)


def mamba_pool(seed: int = 0):
    """SGLang's Mamba state host pool of 2 layers (conv and temporal state per checkpoint slot)."""
    g = torch.Generator().manual_seed(seed or 1)
    slots = 9
    info = MambaStateBufferInfo(temporal=torch.zeros(2, slots, 4, 8), conv=(torch.zeros(2, slots, 3, 16),))
    pool = MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, device="cpu", layout="page_first")
    if seed:
        for t in pool_tensors(pool):
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return pool


def pool_tensors(pool):
    return [t for t in vars(pool).values() if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() > 0
            and t.is_floating_point()]


def attach(server, seed=0, with_mamba=False):
    kv, swa = host_pool("page_first", seed=seed), swa_pool(seed)
    b = backend(config(server), kv)
    b.register_mem_host_pool_v2(swa, PoolName.SWA)
    mamba = None
    if with_mamba:
        mamba = mamba_pool(seed)
        b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    b.on_host_pools_registered()
    return b, kv, swa, mamba


def test_a_swa_pool_round_trips_and_gates_the_prefix_by_its_trailing_pages(server):
    keys = page_keys(6, seed=21)
    src, kv, swa, _ = attach(server, seed=3)
    # The controller's backup: the KV pages through v1, the SWA pool's pages through v2 (here
    # every page's; a window would write the trailing ones).
    assert src.batch_set_v1(keys, indices(range(6))) == [True] * 6
    assert src.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=indices(range(4)), keys=keys[:4])]) == \
        {"swa": [True] * 4}

    dst, kv2, swa2, _ = attach(server)
    trailing = PoolTransfer(name=PoolName.SWA, keys=keys[:2], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    # KV has 6 pages, the SWA pool pages 0-3: a 2-page window restores prefixes ending at 2..4
    # only, so the hit is 4 pages.
    res = dst.batch_exists_v2(keys, [trailing])
    assert (res.kv_hit_pages, res.extra_pool_hit_pages) == (4, {"kv": 6, "swa": 4}), res
    assert res.restorable_prefix_pages == [4]
    # The controller then reads the KV pages (v1) and the window's pages (v2) into other slots.
    assert dst.batch_get_v1(keys[:4], indices([7, 8, 9, 10])) == [True] * 4
    got = dst.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=indices([11, 12]), keys=keys[2:4])])
    assert got == {"swa": [True, True]}
    assert same_pages(kv, [0, 1, 2, 3], kv2, [7, 8, 9, 10]) and same_pages(swa, [2, 3], swa2, [11, 12])
    # Every page's policy: the SWA pool's 4 pages cut the prefix at 4 too.
    every = PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    assert dst.batch_exists_v2(keys, [every]).kv_hit_pages == 4
    # Nothing of the SWA pool: no prefix.
    assert dst.batch_exists_v2(page_keys(3, seed=22), [trailing]).kv_hit_pages == 0
    dst.close()
    src.close()
    assert server.shard_sum("leases") == 0, "every lease the lookups took is given back"


def test_a_mamba_state_pool_round_trips_its_checkpoint_slots(server):
    keys = page_keys(3, seed=23)
    src, kv, _, mamba = attach(server, seed=5, with_mamba=True)
    assert src.batch_set_v1(keys, indices(range(3))) == [True] * 3
    # The state at the end of the prefix: one checkpoint slot (Mamba pages are one slot).
    state = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([4]), keys=keys[2:3])
    assert src.batch_set_v2([state]) == {"mamba": [True]}

    dst, _, _, mamba2 = attach(server, with_mamba=True)
    want = PoolTransfer(name=PoolName.MAMBA, keys=keys[2:3], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    swa_none = PoolTransfer(name=PoolName.SWA, keys=keys[:1], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert dst.batch_exists_v2(keys, [want]).kv_hit_pages == 3
    # The state of a shorter prefix was never saved: 2 pages are not restorable.
    assert dst.batch_exists_v2(keys[:2], [want]).kv_hit_pages == 0
    # Nor is a prefix whose SWA pool has nothing.
    assert dst.batch_exists_v2(keys, [want, swa_none]).kv_hit_pages == 0
    got = dst.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([6]), keys=keys[2:3])])
    assert got == {"mamba": [True]}
    assert torch.equal(mamba.get_data_page(4), mamba2.get_data_page(6))
    assert not torch.equal(mamba.get_data_page(4), mamba2.get_data_page(5)), "a slot not read stays as it was"
    dst.close()
    src.close()


def test_what_is_no_host_pool_is_refused_naming_its_class(server):
    b = backend(config(server), host_pool("page_first"))

    class RadixSidecar:  # an object with no flat data pages
        pass

    with pytest.raises(ValueError, match=r"cannot store SGLang's RadixSidecar \(indexer pool\): it has no flat "
                                         r"data pages .* serve this model without --hicache-storage-backend"):
        b.register_mem_host_pool_v2(RadixSidecar(), PoolName.INDEXER)
    with pytest.raises(ValueError, match="no host pool 'mamba' was registered"):
        b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1]), keys=page_keys(1))])
    b.close()
