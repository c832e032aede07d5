"""`OrbitKVStorage`: SGLang's `HiCacheStorage` backed by the host's OrbitKV Manager.

One chunk is one page of SGLang's host KV pool (every layer, K and V), keyed by SGLang's own
chained page hash (a SHA-256 hex string, mapped by `orbitkv.chunk_digest`) in a namespace of
the engine's shape: model, KV dtype, layers, heads, head dim, page size, host pool layout, TP
rank (MHA; MLA pages are the same on every rank, so all ranks share one namespace), PP and
attention CP ranks.

`batch_get_v1` / `batch_set_v1` copy pages straight between the host pool and the arena (no
copy on our side; several threads for large batches: `copy_threads`). `batch_exists` leases
the prefix it reports, so that a page reported present can still be read when SGLang asks for
it; the lease ends when the page is read, or after `lease_seconds` if it never is (SGLang
reads fewer pages than reported when another rank has fewer).

Hybrid models (SGLang's hybrid cache controller: sliding-window and Mamba / linear-attention
models) hand their other host pools to the backend (`register_mem_host_pool_v2`) and move
their pages with `batch_exists_v2` / `batch_get_v2` / `batch_set_v2`. Each pool has a namespace
of its own (the pool's name in the model name): token KV pools (`MHATokenToKVPoolHost`,
`MLATokenToKVPoolHost`, e.g. the SWA pool) are copied page by page as the main pool is; any
other host pool (a Mamba state pool's checkpoint slots) as SGLang's flat data pages, bytes as
the pool gives them. `batch_exists_v2` reports a prefix only where every pool holds what its
hit policy asks (every page, or the trailing pages of the prefix); the pages it reports stay
leased until read.

A Manager that is down or restarting makes misses (logged once per outage); the client
reconnects with backoff. SGLang never fails because of the cache.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

try:  # SGLang's hybrid pool API (0.5.23): its pool transfers and their hit policies
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransferResult
except ImportError:  # an SGLang without it never calls the *_v2 methods
    PoolHitPolicy = PoolTransferResult = None  # type: ignore[assignment,misc,unused-ignore]

from .. import ChunkKey, Client, NamespaceDescriptor, OrbitKVError, Region, ServerError, chunk_digest
from .._dtypes import okv_dtype
from .._outage import Outage

log = logging.getLogger("orbitkv.sglang")

#: The layout version of each host pool layout (the order of a page's bytes), MHA and MLA.
LAYOUT_VERSIONS = {
    ("mha", "layer_first"): 201,
    ("mha", "page_first"): 202,
    ("mha", "page_first_direct"): 203,
    ("mha", "page_head"): 204,
    ("mla", "layer_first"): 211,
    ("mla", "page_first"): 212,
    ("mla", "page_first_direct"): 213,
}
#: The layout version of another host pool's pages: SGLang's flat data page, as bytes.
FLAT_PAGE_LAYOUT = 230
#: SGLang's host pool classes whose pages are token KV (copied as the main pool's).
TOKEN_KV_POOLS = {"MHATokenToKVPoolHost": "mha", "MLATokenToKVPoolHost": "mla"}
#: How many prefix ends a trailing-pages pool is looked up at before it is a miss.
TRAILING_TRIES = 4


@dataclasses.dataclass
class _Pool:
    """A host pool the backend moves pages of: its namespace, page size and bytes per page;
    `regions` for a token KV pool (copied straight), None for flat data pages."""

    name: str
    pool: Any
    ns_id: int
    page_size: int
    chunk_bytes: int
    regions: Optional[List[Region]]


@dataclasses.dataclass
class StorageStats:
    """What `get_stats` returns, in the fields SGLang's storage metrics read: pages per
    prefetch and backup batch, and their bandwidths (GB/s), since the last call."""

    prefetch_pgs: List[int] = dataclasses.field(default_factory=list)
    backup_pgs: List[int] = dataclasses.field(default_factory=list)
    prefetch_bandwidth: List[float] = dataclasses.field(default_factory=list)
    backup_bandwidth: List[float] = dataclasses.field(default_factory=list)


def _digest(key: str) -> bytes:
    """SGLang's page hash (64 hex digits) as a chunk digest; any other key by its text."""
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raw = b""
    return chunk_digest(raw if len(raw) == 32 else key.encode())


class OrbitKVStorage(HiCacheStorage):
    """See the module docs. Extra config (`--hicache-storage-backend-extra-config`, beside
    SGLang's own keys): `socket` (default: the Manager's default socket), `namespace_model`
    (default SGLang's model name), `request_timeout` (seconds, default 10), `copy_threads`
    (default: up to 4 of this process's CPUs), `lease_seconds` (default 30),
    `max_held_leases` (default 16384, a quarter of the Manager's default lease limit per
    session)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[Dict[str, Any]] = None) -> None:
        self.config = storage_config
        ex = dict(getattr(storage_config, "extra_config", None) or {})
        self.extra = ex
        if getattr(storage_config, "should_split_heads", False):
            raise ValueError("OrbitKVStorage does not split heads across TP ranks (tp_lcm_size): drop that setting")
        self.is_mla = bool(storage_config.is_mla_model)
        self.client = Client(
            ex.get("socket"),
            name=f"sglang-tp{storage_config.tp_rank}-pp{storage_config.pp_rank}",
            request_timeout=float(ex.get("request_timeout", 10.0)),
            connect=False,
            copy_threads=int(ex.get("copy_threads", min(4, len(os.sched_getaffinity(0))))),
            client_checksums=bool(ex.get("client_checksums", True)),
        )
        self.lease_seconds = float(ex.get("lease_seconds", 30.0))
        self.max_held = int(ex.get("max_held_leases", 16384))
        self.mem_pool_host: Any = None
        self.regions: List[Region] = []
        self.page_size = 0
        self.chunk_bytes = 0
        self.ns_id: Optional[int] = None
        #: Every host pool by SGLang's pool name: the main one (`kv`) and a hybrid model's others.
        self.pools: Dict[str, _Pool] = {}
        self._policies_logged: Set[Any] = set()
        self._lock = threading.Lock()
        #: key (a KV page's, or (pool name, key) of another pool's) -> (lease, when taken,
        #: connection): leases batch_exists took, until read.
        self._held: "collections.OrderedDict[Any, Tuple[Any, float, Any]]" = collections.OrderedDict()
        self._stats = StorageStats()
        self._outage = Outage(log)

    # ------------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        kind = "mla" if self.is_mla else "mha"
        self.regions, self.page_size, self.num_pages, desc = self._token_pool(mem_pool_host, kind, "")
        self.chunk_bytes = sum(r.block_bytes for r in self.regions)
        self.ns_id = desc.id
        self.pools["kv"] = _Pool("kv", mem_pool_host, desc.id, self.page_size, self.chunk_bytes, self.regions)
        self._register(desc)
        log.info("OrbitKV storage: %s pool %s, %d pages of %d tokens, %d bytes per chunk, namespace %#x",
                 kind.upper(), mem_pool_host.layout, self.num_pages, self.page_size, self.chunk_bytes, self.ns_id)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Another host pool of a hybrid model (SWA, Mamba, ...); `ValueError` naming the pool
        class for one OrbitKV cannot move (SGLang then fails the attach, at start)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name == "kv" or host_pool is self.mem_pool_host:
            return
        cls = type(host_pool).__name__
        if cls in TOKEN_KV_POOLS:
            regions, page, pages, desc = self._token_pool(host_pool, TOKEN_KV_POOLS[cls], f"#pool.{name}")
            pool = _Pool(name, host_pool, desc.id, page, sum(r.block_bytes for r in regions), regions)
            how = f"{TOKEN_KV_POOLS[cls].upper()} pages, layout {host_pool.layout}"
        else:
            flat = getattr(host_pool, "get_dummy_flat_data_page", None)
            if not callable(flat) or not callable(getattr(host_pool, "set_from_flat_data_page", None)):
                raise ValueError(
                    f"OrbitKVStorage cannot store SGLang's {cls} ({name} pool): it has no flat data pages "
                    "(get_data_page / set_from_flat_data_page); serve this model without "
                    "--hicache-storage-backend, or with another backend"
                )
            page_bytes = flat()
            if getattr(page_bytes, "device", None) is None or page_bytes.device.type != "cpu":
                raise ValueError(f"OrbitKVStorage: SGLang's {cls} ({name} pool) gives no CPU flat data page")
            nbytes = page_bytes.numel() * page_bytes.element_size()
            c = self.config
            desc = NamespaceDescriptor(
                model=f"{self._model()}#pool.{name}.{cls}"[:256], dtype="u8", num_layers=1, num_kv_heads=1,
                head_dim=nbytes, tokens_per_chunk=1, kv_tensors=1, layout_version=FLAT_PAGE_LAYOUT,
                tp_rank=int(c.tp_rank), tp_world_size=int(c.tp_size),
            )
            pool = _Pool(name, host_pool, desc.id, int(getattr(host_pool, "page_size", 1) or 1), nbytes, None)
            how = f"{cls} flat data pages"
        self.pools[name] = pool
        self._register(desc)
        log.info("OrbitKV storage: %s pool (%s), %d bytes per page, namespace %#x", name, how, pool.chunk_bytes,
                 pool.ns_id)

    def _register(self, desc: NamespaceDescriptor) -> None:
        try:
            self.client.register_namespace(desc)  # remembered while the Manager is away
            self._outage.ok(self.client.session_id)
        except OrbitKVError as e:
            self._outage.failed(e, "register namespace")

    def _token_pool(self, pool: Any, kind: str, suffix: str) -> Tuple[List[Region], int, int, NamespaceDescriptor]:
        """A token KV host pool's regions (one per part of a page), page size, pages and
        namespace (`suffix` added to the model name)."""
        layout = str(pool.layout)
        if (kind, layout) not in LAYOUT_VERSIONS:
            raise ValueError(
                f"OrbitKVStorage copies the host pool layouts layer_first, page_first, page_first_direct"
                f"{', page_head' if kind == 'mha' else ''} ({kind.upper()}); this pool is {layout!r}"
            )
        buf = pool.kv_buffer
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError(f"the host pool's kv_buffer must be one contiguous CPU tensor ({buf.device})")
        page = int(pool.page_size)
        pages = int(pool.size) // page
        regions = []
        for part in self._parts(buf, kind, layout):
            if part.nbytes % pages:
                raise ValueError(f"a host pool part of {part.nbytes} bytes is not {pages} equal pages")
            regions.append(Region(part, block_bytes=part.nbytes // pages))
        return regions, page, pages, self._namespace(pool, kind, layout, suffix)

    @staticmethod
    def _parts(buf: Any, kind: str, layout: str) -> List[Any]:
        """The pool's tensors whose dim 0 is the token or the page, in chunk order: K before V,
        layer by layer (the order of SGLang's flat data pages)."""
        if kind == "mha":
            if layout == "layer_first":  # [2, L, size, H, D]
                return [buf[kv, layer] for kv in range(2) for layer in range(int(buf.shape[1]))]
            return [buf[0], buf[1]]  # [2, size | page_num, ...]
        if layout == "layer_first":  # [L, size, 1, dim]
            return [buf[layer] for layer in range(int(buf.shape[0]))]
        return [buf]  # [size | page_num, ...]

    def _model(self) -> str:
        c = self.config
        model = str(self.extra.get("namespace_model") or c.model_name or "sglang")
        if c.pp_size > 1:
            model += f"#pp{c.pp_rank}/{c.pp_size}"
        if c.attn_cp_size > 1:
            model += f"#cp{c.attn_cp_rank}/{c.attn_cp_size}"
        return model

    def _namespace(self, pool: Any, kind: str, layout: str, suffix: str = "") -> NamespaceDescriptor:
        c = self.config
        model = self._model() + suffix
        mla = kind == "mla"
        head_dim = int(pool.kv_cache_dim) if mla else int(pool.head_dim)
        return NamespaceDescriptor(
            model=model[:256],
            dtype=okv_dtype(pool.dtype),
            num_layers=int(pool.layer_num),
            num_kv_heads=1 if mla else int(pool.head_num),
            head_dim=head_dim,
            tokens_per_chunk=int(pool.page_size),
            kv_tensors=1 if mla else 2,
            layout_version=LAYOUT_VERSIONS[(kind, layout)],
            tp_rank=0 if mla else int(c.tp_rank),
            tp_world_size=1 if mla else int(c.tp_size),
        )

    # ------------------------------------------------------------------ helpers

    def _keys(self, keys: List[str]) -> List[ChunkKey]:
        if self.ns_id is None:
            raise RuntimeError("register_mem_pool_host first")
        return [ChunkKey(self.ns_id, _digest(k)) for k in keys]

    def _starts(self, host_indices: Any, n: int, page_size: Optional[int] = None) -> List[int]:
        """The host index of the first token of each of `n` pages: host_indices holds n pages."""
        size = page_size or self.page_size
        idx = host_indices.tolist() if hasattr(host_indices, "tolist") else list(host_indices)
        if len(idx) != n * size:
            raise ValueError(f"{len(idx)} host indices for {n} pages of {size} tokens")
        starts = idx[::size]
        bad = [s for s in starts if s % size]
        if bad:
            raise ValueError(f"host index {bad[0]} does not start a page of {size} tokens")
        return starts

    def _pages(self, host_indices: Any, n: int, page_size: Optional[int] = None) -> List[int]:
        """The host pool page of each of `n` keys: host_indices holds n pages of tokens."""
        size = page_size or self.page_size
        return [s // size for s in self._starts(host_indices, n, size)]

    def _release(self, keys: Optional[List[Any]] = None, now: Optional[float] = None) -> None:
        """Ends the leases batch_exists took: of `keys`, or those held past `lease_seconds`
        or beyond `max_held_leases` (oldest first), or all."""
        with self._lock:
            if keys is None and now is None:
                done = list(self._held.values())
                self._held.clear()
            else:
                done = [self._held.pop(k) for k in (keys or []) if k in self._held]
                while self._held:
                    k, (_, t, _) = next(iter(self._held.items()))
                    if len(self._held) <= self.max_held and (now is None or now - t < self.lease_seconds):
                        break
                    done.append(self._held.pop(k))
        self._give_back(done)

    def _give_back(self, held: List[Tuple[Any, float, Any]]) -> None:
        """Releases held leases of the live connection; those of one that ended went with it
        (one stale lease would make the whole release fail)."""
        session = self.client.connection
        leases = [lease for lease, _, s in held if s == session]
        if leases:
            try:
                self.client.release_deferred(leases)
            except OrbitKVError:
                pass

    # ------------------------------------------------------------------ the v1 interface

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading pages of `keys` the Manager has; they stay leased until read."""
        if not keys:
            return 0
        now = time.monotonic()
        self._release(now=now)
        try:
            try:
                leases = self.client.lookup_leased(self._keys(keys))
            except ServerError as e:
                if e.code != "lease_limit":
                    raise
                self._release()  # everything held, then once more
                leases = self.client.lookup_leased(self._keys(keys))
            self._outage.ok(self.client.session_id)
        except OrbitKVError as e:
            self._outage.failed(e, "lookup")
            return 0
        self._hold(keys, leases, now)
        return len(leases)

    def _hold(self, keys: List[Any], leases: List[Any], now: float) -> None:
        """Keeps `leases` (of `keys`: a KV page's key, or (pool name, key)) until their pages are
        read; a lease held before under the same key is given back."""
        session, stale = self.client.connection, []
        with self._lock:
            for k, lease in zip(keys, leases):
                old = self._held.pop(k, None)
                if old is not None:
                    stale.append(old)
                self._held[k] = (lease, now, session)
        self._give_back(stale)

    def batch_get_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Reads pages into the host pool: True for each page of the present prefix."""
        try:
            return self._copy("prefetch", keys, host_indices, self.client.load_blocks, ("done",))
        finally:
            self._release(keys)

    def batch_set_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Writes pages from the host pool: True for each page stored or already there."""
        return self._copy("backup", keys, host_indices, self.client.save_blocks, ("stored", "already_present"))

    def _copy(self, what: str, keys: List[str], host_indices: Any, call: Any, good: Tuple[str, ...]) -> List[bool]:
        """`call(regions, keys, pages)` (load_blocks or save_blocks), its outcomes as SGLang's
        booleans; every page False if the Manager cannot be reached."""
        if not keys:
            return []
        pages = self._pages(host_indices, len(keys))
        t0 = time.perf_counter()
        try:
            out = call(self.regions, self._keys(keys), pages)
            self._outage.ok(self.client.session_id)
        except OrbitKVError as e:
            self._outage.failed(e, "read" if what == "prefetch" else "write")
            out = []
        ok = [o in good for o in out] + [False] * (len(keys) - len(out))
        self._count(what, sum(ok), time.perf_counter() - t0)
        return ok

    def _count(self, what: str, pages: int, seconds: float, chunk_bytes: int = 0) -> None:
        if not pages:
            return
        gbps = pages * (chunk_bytes or self.chunk_bytes) / max(seconds, 1e-9) / 1e9
        with self._lock:
            getattr(self._stats, f"{what}_pgs").append(pages)
            getattr(self._stats, f"{what}_bandwidth").append(gbps)

    # ------------------------------------------------------------------ hybrid pools (v2)

    def _pool(self, name: Any) -> _Pool:
        key = str(getattr(name, "value", name))
        pool = self.pools.get(key)
        if pool is None:
            raise ValueError(f"OrbitKVStorage: no host pool {key!r} was registered")
        return pool

    def _lease(self, pool: _Pool, keys: List[str]) -> List[Any]:
        """Leases the longest present prefix of a pool's `keys`, held as batch_exists' are."""
        if not keys:
            return []
        leases = self.client.lookup_leased([ChunkKey(pool.ns_id, _digest(k)) for k in keys])
        self._hold([(pool.name, k) for k in keys], leases, time.monotonic())
        return leases

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[Any]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Any:
        """The longest prefix of `keys` every pool can restore: the KV pages, and of each
        transfer's pool every page (`all_pages`) or the pages its transfer's keys number at
        the prefix's end (`trailing_pages`). The pages reported stay leased until read."""
        kv = self.batch_exists(keys, extra_info)
        hits: Dict[str, int] = {"kv": kv} if kv else {}
        restorable = set(range(1, kv + 1))
        try:
            for t in pool_transfers or ():
                if not restorable:
                    break
                pool = self._pool(t.name)
                policy = str(getattr(t.hit_policy, "value", t.hit_policy))
                if policy == "all_pages":
                    have = len(self._lease(pool, keys[:kv]))
                    ok = set(range(1, have + 1))
                elif policy == "trailing_pages":
                    trailing = max(1, len(t.keys or ()))
                    ok = set()
                    for end in sorted(restorable, reverse=True)[:TRAILING_TRIES]:
                        start = max(0, end - trailing)
                        if len(self._lease(pool, keys[start:end])) == end - start:
                            ok.add(end)
                            break
                        self._release([(pool.name, k) for k in keys[start:end]])
                else:
                    if policy not in self._policies_logged:
                        self._policies_logged.add(policy)
                        log.warning("OrbitKV storage: pool %s asks for hit policy %s, which OrbitKV does not "
                                    "serve: such prefixes are misses", pool.name, policy)
                    ok = set()
                if ok:
                    hits[pool.name] = max(ok)
                restorable &= ok
            self._outage.ok(self.client.session_id)
        except OrbitKVError as e:
            self._outage.failed(e, "lookup")
            restorable = set()
        final = max(restorable, default=0)
        return PoolTransferResult(final, hits, sorted(restorable))

    def batch_get_v2(self, transfers: List[Any],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
        """Reads each transfer's pages into its pool: per pool, True for each page read."""
        out: Dict[str, List[bool]] = {}
        for t in transfers:
            pool, keys = self._pool(t.name), list(t.keys or ())
            try:
                out[pool.name] = self._move_v2("prefetch", pool, keys, t.host_indices)
            finally:
                self._release([(pool.name, k) for k in keys] if pool.name != "kv" else keys)
        return out

    def batch_set_v2(self, transfers: List[Any],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
        """Writes each transfer's pages from its pool: per pool, True for each page stored or
        already there."""
        out: Dict[str, List[bool]] = {}
        for t in transfers:
            pool = self._pool(t.name)
            out[pool.name] = self._move_v2("backup", pool, list(t.keys or ()), t.host_indices)
        return out

    def _move_v2(self, what: str, pool: _Pool, keys: List[str], host_indices: Any) -> List[bool]:
        if not keys:
            return []
        if pool.regions is not None:
            call = self.client.load_blocks if what == "prefetch" else self.client.save_blocks
            good = ("done",) if what == "prefetch" else ("stored", "already_present")
            pages = self._pages(host_indices, len(keys), pool.page_size)
            t0 = time.perf_counter()
            try:
                res = call(pool.regions, [ChunkKey(pool.ns_id, _digest(k)) for k in keys], pages)
                self._outage.ok(self.client.session_id)
            except OrbitKVError as e:
                self._outage.failed(e, "read" if what == "prefetch" else "write")
                res = []
            ok = [o in good for o in res] + [False] * (len(keys) - len(res))
            self._count(what, sum(ok), time.perf_counter() - t0, pool.chunk_bytes)
            return ok
        import torch

        starts = self._starts(host_indices, len(keys), pool.page_size)
        ckeys = [ChunkKey(pool.ns_id, _digest(k)) for k in keys]
        t0 = time.perf_counter()
        try:
            if what == "prefetch":
                bufs = [pool.pool.get_dummy_flat_data_page() for _ in keys]
                lens = self.client.get_into(ckeys, [b.view(torch.uint8) for b in bufs])
                ok = [False] * len(keys)
                for i, n in enumerate(lens):
                    if n == pool.chunk_bytes:
                        pool.pool.set_from_flat_data_page(starts[i], bufs[i])
                        ok[i] = True
                    else:
                        break  # another length under the key: not this pool's page
            else:
                pages = [pool.pool.get_data_page(s, flat=True).contiguous().view(torch.uint8) for s in starts]
                res = self.client.put(list(zip(ckeys, pages)))
                ok = [o in ("stored", "already_present") for o in res] + [False] * (len(keys) - len(res))
            self._outage.ok(self.client.session_id)
        except OrbitKVError as e:
            self._outage.failed(e, "read" if what == "prefetch" else "write")
            ok = [False] * len(keys)
        self._count(what, sum(ok), time.perf_counter() - t0, pool.chunk_bytes)
        return ok

    # ------------------------------------------------------------------ the older interface

    def exists(self, key: str) -> bool:
        try:
            return len(self.client.lookup(self._keys([key]))) == 1
        except OrbitKVError as e:
            self._outage.failed(e, "lookup")
            return False

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Any:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Any]:
        """Each page as a flat tensor (SGLang's flat data page, or a new uint8 tensor), None
        from the first page missing on."""
        import torch

        if target_locations is None:
            target_locations = [torch.empty(self.chunk_bytes, dtype=torch.uint8) for _ in keys]
        try:
            lens = self.client.get_into(self._keys(keys), list(target_locations))
            self._outage.ok(self.client.session_id)
        except OrbitKVError as e:
            self._outage.failed(e, "read")
            lens = []
        return [t if i < len(lens) else None for i, t in enumerate(target_locations)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Stores flat pages; True when every one is stored or already there."""
        if values is None or len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys need as many values")
        try:
            out = self.client.put(list(zip(self._keys(keys), [v.contiguous() for v in values])))
            self._outage.ok(self.client.session_id)
        except OrbitKVError as e:
            self._outage.failed(e, "write")
            return False
        return all(o in ("stored", "already_present") for o in out)

    # ------------------------------------------------------------------ the rest

    def clear(self) -> None:
        """Ends this backend's leases. The Manager's pages stay: the cache is shared with the
        host's other engines (`orbitkv-ctl evict` or a restart empties it)."""
        self._release()
        log.info("OrbitKV storage: clear ends this engine's leases; the Manager's cache is shared and stays")

    def get_stats(self) -> StorageStats:
        with self._lock:
            stats, self._stats = self._stats, StorageStats()
        return stats

    def close(self) -> None:
        self._release()
        try:
            self.client.flush()
        except OrbitKVError:
            pass
