"""torch CUDA helpers: naming a GPU and sharing KV tensors with the server by CUDA IPC.

Only imported when GPU features are used; importing it needs torch.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ._native import InvalidArgument, Stale


def device_uuid(device: Any = None) -> str:
    """The `GPU-...` UUID of a torch CUDA device (as `nvidia-smi -L` prints it)."""
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    return "GPU-" + str(torch.cuda.get_device_properties(dev).uuid)


def _cuda_ipc_handle(shareable: bytes) -> bytes:
    """The `cudaIpcMemHandle_t` in PyTorch's shareable handle: a version byte, a kind byte
    (`c`: a cudaMalloc'd block; `e`: an expandable segment) and then the kind's handle."""
    if len(shareable) == 64:
        return shareable
    if len(shareable) == 66 and shareable[1:2] == b"c":
        return shareable[2:]
    if len(shareable) >= 2 and shareable[1:2] == b"e":
        raise InvalidArgument(
            "the tensor lies in an expandable segment, which CUDA IPC cannot share: run the engine "
            "with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, or use orbitkv.gpu.EngineCopies"
        )
    raise InvalidArgument(f"unknown PyTorch shareable CUDA handle ({len(shareable)} bytes, {shareable[:2]!r})")


def ipc_triple(tensor: Any) -> Tuple[bytes, int, int]:
    """(64-byte CUDA IPC handle of the allocation, byte offset of `tensor` in it, its bytes)."""
    if not getattr(tensor, "is_cuda", False):
        raise InvalidArgument("register_gpu takes CUDA tensors (or (handle, offset, len) triples)")
    if not tensor.is_contiguous():
        raise InvalidArgument("register_gpu takes contiguous tensors")
    storage = tensor.untyped_storage()
    shared = storage._share_cuda_()
    handle, storage_offset = _cuda_ipc_handle(bytes(shared[1])), shared[3]
    offset = storage_offset + tensor.storage_offset() * tensor.element_size()
    return bytes(handle), int(offset), tensor.numel() * tensor.element_size()


_HOST_LOCK = threading.Lock()
#: Address of an arena mapping registered with CUDA -> (length, its owner: (client, connection
#: number), EngineCopies using it). CUDA knows a registration by its address alone: a new
#: connection's mapping may land where an old one was, and then the old registration is dropped
#: first.
_HOST_USERS: Dict[int, Tuple[int, Any, int]] = {}


def _cuda_driver() -> Any:
    """libcuda, for host registrations: unlike the runtime's, a failed driver call leaves no
    error behind for torch's next kernel launch to report as its own."""
    import ctypes

    return ctypes.CDLL("libcuda.so.1")


def _host_register(base: int, length: int, session: Any, device: Any) -> None:
    import ctypes

    import torch

    with _HOST_LOCK:
        held = _HOST_USERS.get(base)
        if held is not None and held[:2] == (length, session):
            _HOST_USERS[base] = (length, session, held[2] + 1)
            return
        if held is not None:  # an earlier connection's mapping at this address
            _cuda_driver().cuMemHostUnregister(ctypes.c_void_p(base))
            del _HOST_USERS[base]
        torch.cuda.set_device(device)  # the device's context current on this thread
        err = _cuda_driver().cuMemHostRegister_v2(ctypes.c_void_p(base), ctypes.c_size_t(length), 0)
        if err != 0:
            raise InvalidArgument(f"cuMemHostRegister of the {length}-byte arena failed: CUDA error {err}")
        _HOST_USERS[base] = (length, session, 1)


def _host_unregister(key: Tuple[int, int, Any]) -> None:
    import ctypes

    base, length, session = key
    with _HOST_LOCK:
        held = _HOST_USERS.get(base)
        if held is None or held[:2] != (length, session):
            return  # already replaced by a newer connection's registration
        if held[2] > 1:
            _HOST_USERS[base] = (length, session, held[2] - 1)
        else:
            del _HOST_USERS[base]
            _cuda_driver().cuMemHostUnregister(ctypes.c_void_p(base))


class EngineCopies:
    """The path without CUDA IPC: this process copies between its GPU tensors and its own
    mapping of the arena, which it registers with CUDA (`cuMemHostRegister`; once per mapping
    in a process, however many EngineCopies use it) so that the copy engines reach it
    directly. For containers without hostIPC: the Manager never opens the engine's GPU memory.

    A chunk is the concatenation of its pieces (contiguous CUDA tensors), in the order given:
    give them in the server's chunk order (layer by layer, K before V, as `Client.save` packs
    them) and both paths read each other's chunks. Copies run on `stream` (default: the
    current stream) and are waited for before a save commits or a load releases its leases.
    Use it from one thread, with its client used by nobody else meanwhile.
    """

    def __init__(self, client: Any, stream: Any = None) -> None:
        self.client = client
        self.stream = stream
        self._session: Any = None
        self._arena: Any = None
        self._keys: List[Tuple[int, int, Any]] = []

    def close(self) -> None:
        """Gives up this object's use of the arena's CUDA registration (the last user
        unregisters it; also done when the session changes)."""
        for key in self._keys:
            _host_unregister(key)
        self._session, self._arena, self._keys = None, None, []

    def _arena_tensor(self, device: Any = None) -> Any:
        """The arena as a pinned uint8 tensor, registered again after a reconnect."""
        import ctypes

        import torch

        mapping = self.client.arena()
        if mapping is None:
            self.client.ping()  # connects, or raises Unavailable
            mapping = self.client.arena()
        base, length, connection, files = mapping
        if connection != self._session:
            self.close()
            dev = device if device is not None else (self.stream.device if self.stream is not None
                                                     else torch.cuda.current_device())
            owner = (id(self.client), connection)
            # One registration per memfd's mapping (a chunk never spans two files).
            keys: List[Tuple[int, int, Any]] = []
            try:
                for offset, n in files:
                    _host_register(base + offset, n, owner, dev)
                    keys.append((base + offset, n, owner))
            except BaseException:
                for key in keys:
                    _host_unregister(key)
                raise
            buf = (ctypes.c_uint8 * length).from_address(base)
            self._arena = torch.frombuffer(buf, dtype=torch.uint8)
            self._session, self._keys = connection, keys
        return self._arena

    def _same_session(self) -> None:
        """The connection the slots or leases belong to is the one whose mapping is registered
        (a reconnect inside the call maps the arena anew: nothing is copied then)."""
        if self.client.connection != self._session:
            self.close()
            raise Stale("the session changed during the call (a Manager restart); try again")

    @staticmethod
    def _bytes(t: Any) -> Any:
        import torch

        if not t.is_cuda or not t.is_contiguous():
            raise InvalidArgument("pieces are contiguous CUDA tensors")
        return t.reshape(-1).view(torch.uint8)

    def _sync(self) -> None:
        import torch

        (self.stream or torch.cuda.current_stream()).synchronize()

    @contextlib.contextmanager
    def _leased(self, keys: Sequence[Any]) -> Iterator[List[Any]]:
        """Leases the present prefix of `keys` for the copies queued in the `with` body (on the
        copy stream), waits for them, and releases (also on failure, once they are done)."""
        import torch

        leases = self.client.lookup_leased(list(keys))
        try:
            self._same_session()
            with torch.cuda.stream(self.stream or torch.cuda.current_stream()):
                yield leases
            self._sync()
        except BaseException:
            self._drain()
            raise
        finally:
            if leases:
                self.client.release_deferred(leases)

    def _drain(self) -> None:
        """After a failure: waits for the copies already queued (best effort), so that no slot
        or lease is given back while a copy may still touch it."""
        try:
            self._sync()
        except Exception:
            pass

    def _store(self, keys: Sequence[Any], lens: List[int], device: Any, fill: Any) -> List[str]:
        """Reserves a slot per key, runs `fill(arena, reserved)` on the copy stream, waits for
        its copies and commits (aborts the slots if anything fails). Outcomes as `save`."""
        import torch

        arena = self._arena_tensor(device)
        reserved = self.client.reserve(list(keys), lens)
        slots = [r for r in reserved if not isinstance(r, str)]
        try:
            self._same_session()
            with torch.cuda.stream(self.stream or torch.cuda.current_stream()):
                fill(arena, reserved)
            self._sync()
        except BaseException:
            self._drain()
            if slots:
                self.client.abort(slots)
            raise
        committed = iter(self.client.commit(slots) if slots else [])
        out = []
        for r in reserved:
            if isinstance(r, str):
                out.append("already_present" if r in ("already_present", "busy") else r)
            else:
                o = next(committed)
                out.append("stored" if o == "done" else o)
        return out

    def save(self, keys: Sequence[Any], pieces: Sequence[Sequence[Any]]) -> List[str]:
        """Stores chunk i as the bytes of `pieces[i]`; an outcome per key (`stored`,
        `already_present`, or why not)."""
        if len(keys) != len(pieces):
            raise InvalidArgument(f"{len(keys)} keys but {len(pieces)} piece lists")
        srcs = [[self._bytes(p) for p in ps] for ps in pieces]

        def fill(arena: Any, reserved: List[Any]) -> None:
            for r, ss in zip(reserved, srcs):
                if isinstance(r, str):
                    continue
                at = r.offset
                for s in ss:
                    arena[at:at + s.numel()].copy_(s, non_blocking=True)
                    at += s.numel()

        return self._store(keys, [sum(int(s.numel()) for s in ss) for ss in srcs], None, fill)

    def load(self, keys: Sequence[Any], pieces: Sequence[Sequence[Any]]) -> List[str]:
        """Loads the longest present prefix of `keys` into `pieces[i]` (split as saved): `done`
        per chunk loaded, `not_found` after, `invalid_argument` for a chunk whose length is not
        its pieces' (nothing after it is loaded)."""
        if len(keys) != len(pieces):
            raise InvalidArgument(f"{len(keys)} keys but {len(pieces)} piece lists")
        dsts = [[self._bytes(p) for p in ps] for ps in pieces]
        arena = self._arena_tensor()
        out = ["not_found"] * len(keys)
        with self._leased(keys) as leases:
            for i, (lease, ds) in enumerate(zip(leases, dsts)):
                if lease.len != sum(int(d.numel()) for d in ds):
                    out[i] = "invalid_argument"
                    break
                at = lease.offset
                for d in ds:
                    d.copy_(arena[at:at + d.numel()], non_blocking=True)
                    at += d.numel()
                out[i] = "done"
        return out

    def _runs(self, offsets: Sequence[int], length: int) -> List[Tuple[int, int, int]]:
        """(first row, rows, arena offset) of each run of arena slots lying back to back."""
        runs: List[Tuple[int, int, int]] = []
        for i, off in enumerate(offsets):
            if runs and runs[-1][2] + runs[-1][1] * length == off:
                first, n, at = runs[-1]
                runs[-1] = (first, n + 1, at)
            else:
                runs.append((i, 1, off))
        return runs

    def save_cache(self, keys: Sequence[Any], cache: "GpuKvCache", blocks: Sequence[int], staging: Any) -> List[str]:
        """Saves block `blocks[i]` of `cache` as chunk `keys[i]`, a batch of chunks at a time
        gathered on the GPU into `staging` (a `[rows, chunk_bytes]` uint8 CUDA tensor) and
        copied out in one piece per run of adjacent arena slots. Outcomes as `save`."""
        import torch

        if len(keys) != len(blocks):
            raise InvalidArgument(f"{len(keys)} keys but {len(blocks)} blocks")
        cache.check_blocks(blocks, distinct=False)
        length, rows = cache.chunk_bytes, int(staging.shape[0])

        def fill(arena: Any, reserved: List[Any]) -> None:
            todo = [(blocks[i], r) for i, r in enumerate(reserved) if not isinstance(r, str)]
            for at in range(0, len(todo), rows):
                batch = todo[at:at + rows]
                st = staging[:len(batch)]
                cache.gather(torch.tensor([b for b, _ in batch], device=cache.device), st)
                flat = st.reshape(-1)
                for first, n, off in self._runs([r.offset for _, r in batch], length):
                    arena[off:off + n * length].copy_(flat[first * length:(first + n) * length], non_blocking=True)

        return self._store(keys, [length] * len(keys), cache.device, fill)

    def load_cache(self, keys: Sequence[Any], cache: "GpuKvCache", blocks: Sequence[int], staging: Any) -> List[str]:
        """Loads the longest present prefix of `keys` into blocks `blocks[i]` of `cache`, a
        batch at a time: copied in per run of adjacent arena slots into `staging`, scattered
        on the GPU. Outcomes as `load`."""
        import torch

        if len(keys) != len(blocks):
            raise InvalidArgument(f"{len(keys)} keys but {len(blocks)} blocks")
        cache.check_blocks(blocks, distinct=True)
        arena = self._arena_tensor(cache.device)
        length, rows = cache.chunk_bytes, int(staging.shape[0])
        out = ["not_found"] * len(keys)
        with self._leased(keys) as leases:
            usable = 0
            for lease in leases:
                if lease.len != length:
                    out[usable] = "invalid_argument"
                    break
                usable += 1
            for at in range(0, usable, rows):
                batch = leases[at:min(at + rows, usable)]
                st = staging[:len(batch)]
                flat = st.reshape(-1)
                for first, n, off in self._runs([lease.offset for lease in batch], length):
                    flat[first * length:(first + n) * length].copy_(arena[off:off + n * length], non_blocking=True)
                cache.scatter(torch.tensor(list(blocks[at:at + len(batch)]), device=cache.device), st)
        out[:usable] = ["done"] * usable
        return out


def _dense_page(t: Any) -> Tuple[int, str]:
    """(bytes, order) of one block's page in a `[blocks, H, N, C]` view whose page is dense
    (its H, N and C dims cover one contiguous run, C innermost): order `HNC` or `NHC`."""
    if t.dim() != 4:
        raise InvalidArgument(f"a paged KV cache view is [blocks, heads, tokens, content]; got shape {tuple(t.shape)}")
    _, h, n, c = (int(x) for x in t.shape)
    e = t.element_size()
    sh, sn, sc = (int(t.stride(i)) for i in (1, 2, 3))
    if c > 1 and sc != 1:
        raise InvalidArgument(f"the innermost dim of a KV page must be dense (strides {tuple(t.stride())})")
    order = "HNC" if h == 1 or n == 1 or sh > sn else "NHC"
    inner = {"HNC": ((n, sn), (h, sh)), "NHC": ((h, sh), (n, sn))}[order]
    expect = c
    for size, stride in inner:
        if size > 1 and stride != expect:
            raise InvalidArgument(
                f"a KV page of shape {tuple(t.shape)} with strides {tuple(t.stride())} is not one dense run of bytes"
            )
        expect *= size
    return h * n * c * e, order


class GpuKvCache:
    """An engine rank's paged KV cache on one GPU, read from its per-layer tensors: each a
    `[blocks, heads, tokens, content]` view (vLLM >= 0.32; MLA with one head) whose block
    pages are dense runs of bytes. A chunk is one block of every layer, layer by layer, each
    page's bytes in the engine's order.

    Two shapes are recognised, and both give the same chunk bytes:
    - per layer (vLLM's LBNHC/LBHNC): the layer's pages back to back, server layout `paged`
      (`mla` for MLA);
    - cross-layer (BLNHC/BLHNC): one tensor whose blocks hold every layer's page in turn,
      server layout `cross_layer`.
    Anything else (padded pages, heads outside blocks) is refused, naming what was found.

    `regions()` gives what `Client.register_gpu` takes (the server's DMA threads copy);
    `gather` / `scatter` move whole chunks for `EngineCopies.save_cache` / `load_cache` (the
    engine copies).
    """

    def __init__(self, layers: Sequence[Any], *, mla: bool = False) -> None:
        if not layers:
            raise InvalidArgument("no KV cache tensors")
        self.device = layers[0].device
        self.dtype = layers[0].dtype
        self.mla = mla
        for i, t in enumerate(layers):
            if t.device != self.device or t.dtype != self.dtype:
                raise InvalidArgument(f"layer {i} is {t.dtype} on {t.device}, layer 0 {self.dtype} on {self.device}")
            if t.shape != layers[0].shape or t.stride() != layers[0].stride():
                raise InvalidArgument(f"layer {i} has shape {tuple(t.shape)} strides {tuple(t.stride())}, "
                                      f"layer 0 {tuple(layers[0].shape)} {tuple(layers[0].stride())}")
        self.num_layers = len(layers)
        self.num_blocks = int(layers[0].shape[0])
        e = layers[0].element_size()
        self.page_bytes, self.page_order = _dense_page(layers[0])
        _, self.heads, self.block_size, content = (int(x) for x in layers[0].shape)
        stride = int(layers[0].stride(0)) * e
        ptrs = [int(t.data_ptr()) for t in layers]
        storage = layers[0].untyped_storage()
        same_storage = all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in layers)
        if stride == self.page_bytes:
            self.kind = "mla" if mla else "paged"
            self._slabs = [self._slab(t, self.num_blocks * self.page_bytes) for t in layers]
        elif (same_storage and stride == self.num_layers * self.page_bytes
              and all(p == ptrs[0] + i * self.page_bytes for i, p in enumerate(ptrs))):
            self.kind = "cross_layer"
            self._slabs = [self._slab(layers[0], self.num_blocks * stride)]
        else:
            raise InvalidArgument(
                f"KV pages of {self.page_bytes} bytes lie {stride} bytes apart, and the layers are not one "
                "cross-layer tensor in order: OrbitKV copies dense per-layer pages (vLLM's LBNHC/LBHNC) or "
                "cross-layer blocks (BLNHC/BLHNC)"
            )
        self.chunk_bytes = self.num_layers * self.page_bytes
        # The server's layout of the same bytes: per-token K and V halves for FlashAttention
        # pages, the latent row for MLA.
        if self.kind == "mla":
            self.layout_args = (self.num_layers, self.num_blocks, self.block_size, 1, self.heads * content, e)
        else:
            if content % 2:
                raise InvalidArgument(f"a page's content of {content} elements per head cannot be K and V halves")
            self.layout_args = (self.num_layers, self.num_blocks, self.block_size, self.heads, content // 2, e)

    @staticmethod
    def _slab(t: Any, nbytes: int) -> Any:
        """The bytes from `t`'s first element on, as a flat contiguous uint8 tensor."""
        import torch

        storage = t.untyped_storage()
        start = int(t.data_ptr()) - int(storage.data_ptr())
        if start + nbytes > storage.nbytes():
            raise InvalidArgument(f"{nbytes} bytes from offset {start} run past the tensor's storage")
        u = torch.empty(0, dtype=torch.uint8, device=t.device)
        u.set_(storage, start, (nbytes,), (1,))
        return u

    def layout(self) -> Any:
        from .client import KvLayout

        return KvLayout(self.kind, *self.layout_args)

    def regions(self) -> List[Tuple[bytes, int, int]]:
        """The server layout's tensors as CUDA IPC triples, for `Client.register_gpu`."""
        return [ipc_triple(s) for s in self._slabs]

    def check_blocks(self, blocks: Sequence[int], distinct: bool) -> None:
        """Refuses block ids outside the cache (or named twice, for a load), naming one."""
        bad = next((b for b in blocks if not 0 <= b < self.num_blocks), None)
        if bad is not None:
            raise InvalidArgument(f"block {bad} of {self.num_blocks}")
        if distinct and len(set(blocks)) != len(blocks):
            twice = next(b for i, b in enumerate(blocks) if b in blocks[:i])
            raise InvalidArgument(f"block {twice} named twice: a load writes each block once")

    def matches(self, order: str) -> bool:
        """Whether the pages' byte order is `order` (HNC or NHC): with one head or one token
        per page both orders are the same bytes."""
        return self.page_order == order or self.heads == 1 or self.block_size == 1

    def gather(self, blocks: Any, out: Any) -> None:
        """Chunks of `blocks` (a CUDA index tensor) into the rows of `out` (`[len(blocks),
        chunk_bytes]` uint8, contiguous), on the current stream."""
        import torch

        if self.kind == "cross_layer":
            torch.index_select(self._slabs[0].view(self.num_blocks, -1), 0, blocks, out=out)
            return
        rows = out.view(len(blocks), self.num_layers, self.page_bytes)
        for layer, slab in enumerate(self._slabs):
            rows[:, layer].copy_(slab.view(self.num_blocks, -1).index_select(0, blocks))

    def scatter(self, blocks: Any, chunks: Any) -> None:
        """The rows of `chunks` into blocks `blocks`, on the current stream."""
        if self.kind == "cross_layer":
            self._slabs[0].view(self.num_blocks, -1).index_copy_(0, blocks, chunks)
            return
        rows = chunks.view(len(blocks), self.num_layers, self.page_bytes)
        for layer, slab in enumerate(self._slabs):
            slab.view(self.num_blocks, -1).index_copy_(0, blocks, rows[:, layer])


class GpuBlockCopies:
    """Saves and loads blocks of a `GpuKvCache` through `client`, each direction by one of two
    paths:

    - `server`: the cache is registered with the Manager (CUDA IPC) and its DMA threads copy;
      the registration is renewed after a Manager restart;
    - `engine`: this process copies through its CUDA-registered mapping of the arena
      (`EngineCopies`), for containers without CUDA IPC between engine and Manager;
    - `auto`: `server`, and `engine` for good if the Manager refuses the registration (no GPU
      mode there, IPC not possible, memory CUDA IPC cannot share).

    `path` (default `auto`) is the loads' path, and the saves' unless `save_path` names
    another. Why saves may want another: the Manager's copies run in its own CUDA context, and
    without MPS the GPU time-slices contexts, so the engine's kernels wait while the Manager's
    run (on the H200, decode steps 21-22% slower beside saves of other requests by the server
    path with its defaults, 0.3-1.9% by the engine path; docs/performance.md).

    The engine path gathers a batch of chunks at a time into a GPU staging buffer of
    `staging_bytes` (default 64 MiB, at least one chunk; allocated at its first copy) and
    copies each run of adjacent arena slots in one piece.

    Outcomes per key as `Client.save`/`load` give them, with a save's `done` named `stored`.
    Errors of the Manager's session (`Unavailable`, `Disconnected`, ...) are raised. Use it from
    one thread.
    """

    staging_bytes = 64 << 20
    _PATHS = ("auto", "server", "engine")

    def __init__(self, client: Any, cache: GpuKvCache, path: str = "auto", log: Any = None,
                 save_path: Optional[str] = None) -> None:
        for what, p in (("GPU copy path", path), ("GPU save path", save_path)):
            if p is not None and p not in self._PATHS:
                raise InvalidArgument(f"{what} {p!r}: one of auto, server, engine")
        self.client = client
        self.cache = cache
        self.paths = {"load": path, "save": save_path or path}
        self._log = log
        self._reg: Any = None
        self._refused = False  # the Manager refused the registration: `auto` copies in the engine
        self._engine: Any = None
        self._staging: Any = None

    def _resolved(self, op: str) -> str:
        p = self.paths[op]
        if p == "auto":
            return "engine" if self._refused else ("server" if self._reg is not None else "auto")
        return p

    @property
    def active_path(self) -> str:
        """The path loads take now: `engine`, `server`, or `auto` before the first copy."""
        return self._resolved("load")

    @property
    def active_save_path(self) -> str:
        """The path saves take now, as `active_path`."""
        return self._resolved("save")

    def prepare(self) -> None:
        """Does now what the first copies would: registers the cache with the Manager (server
        path) and the arena mapping with CUDA (engine path: about 50 ms per GiB of arena), as
        the two directions need. Errors as a copy would raise them."""
        import torch

        with torch.cuda.device(self.cache.device):
            if any(self._resolved(op) != "engine" for op in self.paths):
                self._registration()
            if "engine" in (self._resolved("load"), self._resolved("save")):
                self._engine_copies()._arena_tensor(self.cache.device)

    def _registration(self) -> Any:
        """The Manager's registration of the cache; None once it refused it (`auto`)."""
        from ._native import OrbitKVError, Unavailable

        if self._reg is None and not self._refused:
            try:
                self._reg = self.client.register_gpu(device_uuid(self.cache.device), self.cache.layout(),
                                                     self.cache.regions())
            except Unavailable:
                raise
            except OrbitKVError as e:
                if "server" in self.paths.values() or not self.client.is_connected:
                    raise
                if self._log is not None:
                    self._log.warning("OrbitKV: the Manager did not take the GPU KV cache (%s); this process "
                                      "copies its pages itself from now on", e)
                self._refused = True
        return self._reg

    def _engine_copies(self) -> Any:
        import torch

        if self._engine is None:
            self._engine = EngineCopies(self.client, stream=torch.cuda.Stream(self.cache.device))
        return self._engine

    def _run(self, op: str, keys: Sequence[Any], blocks: Sequence[int], retried: bool = False) -> List[str]:
        import torch

        with torch.cuda.device(self.cache.device):
            reg = None
            if self._resolved(op) != "engine":
                reg = self._registration()  # None: refused, and `auto` goes to the engine path
            if reg is None:
                engine = self._engine_copies()
                if self._staging is None:
                    rows = max(1, self.staging_bytes // self.cache.chunk_bytes)
                    self._staging = torch.empty(rows, self.cache.chunk_bytes, dtype=torch.uint8,
                                                device=self.cache.device)
                copy = engine.save_cache if op == "save" else engine.load_cache
                outcomes: List[str] = copy(keys, self.cache, blocks, self._staging)
                return outcomes
            copy = self.client.save if op == "save" else self.client.load
            try:
                served: List[str] = copy(reg, keys, blocks)
                return served
            except Stale:
                if retried:
                    raise
                # The registration belonged to a session that ended (a Manager restart):
                # register with the new one (or, refused there, go to the engine path) and copy
                # once more.
                self._reg = None
                return self._run(op, keys, blocks, retried=True)

    def save(self, keys: Sequence[Any], blocks: Sequence[int]) -> List[str]:
        """Block `blocks[i]` as chunk `keys[i]`: `stored`, `already_present`, or why not."""
        return ["stored" if o == "done" else o for o in self._run("save", keys, blocks)]

    def load(self, keys: Sequence[Any], blocks: Sequence[int]) -> List[str]:
        """The longest present prefix of `keys` into `blocks`: `done`, then `not_found`."""
        return self._run("load", keys, blocks)

    def close(self) -> None:
        """Ends the registration (or the arena's CUDA registration); errors are ignored."""
        from ._native import OrbitKVError

        if self._reg is not None:
            try:
                self.client.unregister_gpu(self._reg)
            except OrbitKVError:
                pass
            self._reg = None
        if self._engine is not None:
            self._engine.close()
        self._staging = None
