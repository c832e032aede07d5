"""torch CUDA helpers: naming a GPU and sharing KV tensors with the server by CUDA IPC.

Only imported when GPU features are used; importing it needs torch.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

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


class EngineCopies:
    """The path without CUDA IPC: this process copies between its GPU tensors and its own
    mapping of the arena, which it registers with CUDA (`cudaHostRegister`) so that the copy
    engines reach it directly. For containers without hostIPC: the Manager never opens the
    engine's GPU memory.

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
        self._base = 0

    def close(self) -> None:
        """Unregisters the arena mapping from CUDA (also done when the session changes)."""
        import torch

        if self._base:
            torch.cuda.cudart().cudaHostUnregister(self._base)
        self._session, self._arena, self._base = None, None, 0

    def _arena_tensor(self) -> Any:
        """The arena as a pinned uint8 tensor, registered again after a reconnect."""
        import ctypes

        import torch

        mapping = self.client.arena()
        if mapping is None:
            self.client.ping()  # connects, or raises Unavailable
            mapping = self.client.arena()
        base, length, session = mapping
        if session != self._session:
            self.close()
            err = torch.cuda.cudart().cudaHostRegister(base, length, 0)
            if int(err) != 0:
                raise InvalidArgument(f"cudaHostRegister of the {length}-byte arena failed: {err}")
            buf = (ctypes.c_uint8 * length).from_address(base)
            self._arena = torch.frombuffer(buf, dtype=torch.uint8)
            self._session, self._base = session, base
        return self._arena

    def _same_session(self) -> None:
        """The session the slots or leases belong to is the one whose mapping is registered
        (a reconnect inside the call maps the arena anew: nothing is copied then)."""
        if self.client.session_id != self._session:
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

    def save(self, keys: Sequence[Any], pieces: Sequence[Sequence[Any]]) -> List[str]:
        """Stores chunk i as the bytes of `pieces[i]`; an outcome per key (`stored`,
        `already_present`, or why not)."""
        import torch

        if len(keys) != len(pieces):
            raise InvalidArgument(f"{len(keys)} keys but {len(pieces)} piece lists")
        srcs = [[self._bytes(p) for p in ps] for ps in pieces]
        lens = [sum(int(s.numel()) for s in ss) for ss in srcs]
        arena = self._arena_tensor()
        reserved = self.client.reserve(list(keys), lens)
        slots = [r for r in reserved if not isinstance(r, str)]
        try:
            self._same_session()
            with torch.cuda.stream(self.stream or torch.cuda.current_stream()):
                for r, ss in zip(reserved, srcs):
                    if isinstance(r, str):
                        continue
                    at = r.offset
                    for s in ss:
                        arena[at:at + s.numel()].copy_(s, non_blocking=True)
                        at += s.numel()
            self._sync()
        except BaseException:
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

    def load(self, keys: Sequence[Any], pieces: Sequence[Sequence[Any]]) -> List[str]:
        """Loads the longest present prefix of `keys` into `pieces[i]` (split as saved): `done`
        per chunk loaded, `not_found` after, `invalid_argument` for a chunk whose length is not
        its pieces' (nothing after it is loaded)."""
        import torch

        if len(keys) != len(pieces):
            raise InvalidArgument(f"{len(keys)} keys but {len(pieces)} piece lists")
        dsts = [[self._bytes(p) for p in ps] for ps in pieces]
        arena = self._arena_tensor()
        leases = self.client.lookup_leased(list(keys))
        out = ["not_found"] * len(keys)
        try:
            self._same_session()
            with torch.cuda.stream(self.stream or torch.cuda.current_stream()):
                for i, (lease, ds) in enumerate(zip(leases, dsts)):
                    if lease.len != sum(int(d.numel()) for d in ds):
                        out[i] = "invalid_argument"
                        break
                    at = lease.offset
                    for d in ds:
                        d.copy_(arena[at:at + d.numel()], non_blocking=True)
                        at += d.numel()
                    out[i] = "done"
            self._sync()
        finally:
            if leases:
                self.client.release_deferred(leases)
        return out
