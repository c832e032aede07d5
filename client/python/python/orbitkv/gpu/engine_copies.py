"""`EngineCopies`: the engine's own copies between its GPU memory and the arena."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, List, Sequence, Tuple

from .._native import InvalidArgument, Stale

if TYPE_CHECKING:
    from .kv_cache import GpuKvCache


def _device_index(device: Any) -> int:
    """The CUDA ordinal of a torch device, device index or `cuda:N` string."""
    import torch

    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "cuda":
        raise InvalidArgument(f"{device} is not a CUDA device")
    return d.index if d.index is not None else int(torch.cuda.current_device())


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

    def close(self) -> None:
        """Gives up this object's use of the arena's CUDA registration (unregistered and
        unmapped once nothing uses it; also done when the session changes)."""
        self._session, self._arena = None, None

    def _arena_tensor(self, device: Any = None) -> Any:
        """The arena as a pinned uint8 tensor: the client's mapping of it registered with
        CUDA (`Client.cuda_arena`), taken again after a reconnect."""
        import torch

        if self._arena is None or self.client.connection != self._session:
            self.close()
            dev = device if device is not None else (self.stream.device if self.stream is not None
                                                     else torch.cuda.current_device())
            registered = self.client.cuda_arena(_device_index(dev))
            self._arena = torch.frombuffer(registered, dtype=torch.uint8)
            self._session = registered.connection
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
