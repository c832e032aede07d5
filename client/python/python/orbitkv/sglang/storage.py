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
from typing import Any, Dict, List, Optional, Tuple

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

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
        self._lock = threading.Lock()
        #: key -> (lease, when taken, connection): leases batch_exists took, until read.
        self._held: "collections.OrderedDict[str, Tuple[Any, float, Any]]" = collections.OrderedDict()
        self._stats = StorageStats()
        self._outage = Outage(log)

    # ------------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        layout = str(mem_pool_host.layout)
        kind = "mla" if self.is_mla else "mha"
        if (kind, layout) not in LAYOUT_VERSIONS:
            raise ValueError(
                f"OrbitKVStorage copies the host pool layouts layer_first, page_first, page_first_direct"
                f"{', page_head' if kind == 'mha' else ''} ({kind.upper()}); this pool is {layout!r}"
            )
        buf = mem_pool_host.kv_buffer
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError(f"the host pool's kv_buffer must be one contiguous CPU tensor ({buf.device})")
        page = int(mem_pool_host.page_size)
        pages = int(mem_pool_host.size) // page
        parts = self._parts(buf, kind, layout)
        self.regions = []
        for part in parts:
            if part.nbytes % pages:
                raise ValueError(f"a host pool part of {part.nbytes} bytes is not {pages} equal pages")
            self.regions.append(Region(part, block_bytes=part.nbytes // pages))
        self.page_size = page
        self.num_pages = pages
        self.chunk_bytes = sum(r.block_bytes for r in self.regions)
        desc = self._namespace(mem_pool_host, kind, layout)
        self.ns_id = desc.id
        try:
            self.client.register_namespace(desc)  # remembered while the Manager is away
            self._outage.ok(self.client.session_id)
        except OrbitKVError as e:
            self._outage.failed(e, "register namespace")
        log.info("OrbitKV storage: %s pool %s, %d pages of %d tokens, %d bytes per chunk, namespace %#x",
                 kind.upper(), layout, pages, page, self.chunk_bytes, self.ns_id)

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

    def _namespace(self, pool: Any, kind: str, layout: str) -> NamespaceDescriptor:
        c = self.config
        model = str(self.extra.get("namespace_model") or c.model_name or "sglang")
        if c.pp_size > 1:
            model += f"#pp{c.pp_rank}/{c.pp_size}"
        if c.attn_cp_size > 1:
            model += f"#cp{c.attn_cp_rank}/{c.attn_cp_size}"
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

    def _pages(self, host_indices: Any, n: int) -> List[int]:
        """The host pool page of each of `n` keys: host_indices holds n pages of tokens."""
        idx = host_indices.tolist() if hasattr(host_indices, "tolist") else list(host_indices)
        if len(idx) != n * self.page_size:
            raise ValueError(f"{len(idx)} host indices for {n} pages of {self.page_size} tokens")
        starts = idx[:: self.page_size]
        bad = [s for s in starts if s % self.page_size]
        if bad:
            raise ValueError(f"host index {bad[0]} does not start a page of {self.page_size} tokens")
        return [s // self.page_size for s in starts]

    def _release(self, keys: Optional[List[str]] = None, now: Optional[float] = None) -> None:
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
        session = self.client.connection
        stale = []
        with self._lock:
            for k, lease in zip(keys, leases):
                old = self._held.pop(k, None)
                if old is not None:
                    stale.append(old)
                self._held[k] = (lease, now, session)
        self._give_back(stale)
        return len(leases)

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

    def _count(self, what: str, pages: int, seconds: float) -> None:
        if not pages:
            return
        gbps = pages * self.chunk_bytes / max(seconds, 1e-9) / 1e9
        with self._lock:
            getattr(self._stats, f"{what}_pgs").append(pages)
            getattr(self._stats, f"{what}_bandwidth").append(gbps)

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
