"""`Client`: the Python face of `orbitkv-client` (see the package docs)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import _native
from ._buffers import buffer
from ._native import (
    ArenaMapping,
    ChunkKey,
    GpuRegistration,
    Hit,
    InvalidArgument,
    KvLayout,
    Lease,
    NamespaceDescriptor,
    Reserved,
    Transfer,
)
from .outcome import Outcome, maybe_outcomes, outcomes, slots


def admin(request: Union[str, Dict[str, Any]], socket: Optional[Union[str, "os.PathLike[str]"]] = None,
          timeout: float = 10.0) -> Dict[str, Any]:
    """One request on the admin socket (`<socket>.admin`) of the server at `socket` (default:
    the client's): a command name (`"stats"`) or a request object (`{"cmd": "evict", "all":
    True}`); the answer as it came, whatever its `"ok"` says (docs/operations.md). The same
    client as `orbitkv-ctl`'s. `Unavailable` when no server answers there, `Disconnected` when
    the connection fails or times out."""
    req = {"cmd": request} if isinstance(request, str) else request
    answer = json.loads(_native.admin_request(json.dumps(req), None if socket is None else os.fspath(socket),
                                              timeout))
    if not isinstance(answer, dict):
        raise _native.ProtocolError(f"the admin socket answered {answer!r}, not an object")
    return answer


def default_socket_path() -> str:
    """The socket used when none is given: `$ORBITKV_SOCKET`, else the server's default."""
    return os.fspath(_native.default_socket_path())


@dataclasses.dataclass(frozen=True)
class Namespace:
    """A registered namespace: `id` is the namespace of every key in it."""

    id: int
    max_chunk_bytes: int
    descriptor: NamespaceDescriptor

    def key(self, digest: bytes) -> ChunkKey:
        return ChunkKey(self.id, digest)

    def keys(self, digests: Iterable[bytes]) -> List[ChunkKey]:
        return [ChunkKey(self.id, d) for d in digests]


@dataclasses.dataclass(frozen=True)
class GroupPrefix:
    """What a tensor-parallel group has of a prompt: `chunks` present for every rank."""

    chunks: int
    per_rank: List[int]


@dataclasses.dataclass(frozen=True)
class ArenaInfo:
    """A connection's arena: `length` bytes, `connection` (see `Client.connection`), and each
    of its memfds as (offset, length): one, or one per shard (`--arena-memfds per-shard`)."""

    length: int
    connection: int
    files: List[Tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class Region:
    """Engine memory in blocks: block `b` is `buffer[b * block_stride:][:block_bytes]`.

    A chunk of n blocks is, region by region, its blocks' bytes in order.
    """

    buffer: Any
    block_bytes: int
    block_stride: int = 0  # 0: block_bytes (back to back)


PutItems = Iterable[Tuple[ChunkKey, Any]]


class Client:
    """One session with the local `orbitkv-server`.

    `connect=False` makes a client that connects on its first call, for an engine that must
    start whether or not the server is up. After a failed connect, calls fail at once with
    `Unavailable` until the next attempt is due (the wait doubles from `reconnect_backoff`
    up to `reconnect_backoff_max` seconds). A server restart shows as one `Disconnected` (or
    `Unavailable`) call; the next reconnects and registers this client's namespaces again.

    `copy_threads`: most threads one `put`, `save_blocks` or `load_blocks` copies with (each
    given at least 4 MiB of chunks; default 1, the calling thread). `client_checksums`: those
    calls hash each chunk on the copying thread and commit with the checksums, so that the
    Manager's shards need not (default True).

    A Manager that is still starting (populating its arena) tells clients to wait: a
    connecting client waits for it, up to `start_wait` seconds (default 600), then raises
    `Unavailable` (kind `starting`); a `connect=False` client's calls raise `Unavailable`
    until it serves.

    Safe to share between threads (calls are serialized); each call releases the GIL.
    """

    def __init__(
        self,
        socket: Optional[Union[str, os.PathLike[str]]] = None,
        *,
        name: str = "orbitkv-py",
        request_timeout: float = 10.0,
        connect: bool = True,
        prefault_arena: bool = True,
        reconnect_backoff: float = 0.05,
        reconnect_backoff_max: float = 2.0,
        copy_threads: int = 1,
        client_checksums: bool = True,
        start_wait: float = 600.0,
    ) -> None:
        self._c = _native.NativeClient(
            os.fspath(socket) if socket is not None else None,
            name,
            request_timeout,
            connect,
            prefault_arena,
            reconnect_backoff,
            reconnect_backoff_max,
            copy_threads,
            client_checksums,
            start_wait,
        )
        #: The arena registered with CUDA, per device (`cuda_arena`).
        self._cuda_arenas: Dict[int, ArenaMapping] = {}

    # --- session -------------------------------------------------------------------------

    @property
    def socket(self) -> str:
        return os.fspath(self._c.socket)

    @property
    def session_id(self) -> Optional[int]:
        """The current session (None while disconnected). A restarted Manager numbers its
        sessions from 1 again; `connection` tells this client's connections apart."""
        return self._c.session_id

    @property
    def connection(self) -> Optional[int]:
        """The number of the current connection, new at every connect (None while
        disconnected): leases, reservations and the arena mapping belong to one."""
        return self._c.connection

    @property
    def is_connected(self) -> bool:
        return self._c.is_connected

    @property
    def connect_attempts(self) -> int:
        return self._c.connect_attempts

    @property
    def deferred_failures(self) -> int:
        """Deferred releases of the current session that failed (each is logged too)."""
        return self._c.deferred_failures

    def ping(self) -> None:
        self._c.ping()

    def register_namespace(self, descriptor: NamespaceDescriptor) -> Namespace:
        """Registers a namespace (idempotent). Remembered even if the server is unreachable
        (then `Unavailable` is raised): every later session registers it."""
        ns_id, max_chunk = self._c.register_namespace(descriptor)
        return Namespace(ns_id, max_chunk, descriptor)

    # --- lookups and leases --------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> List[Hit]:
        """The longest present prefix of `keys`, not leased."""
        return self._c.lookup(list(keys))

    def lookup_leased(self, keys: Sequence[ChunkKey]) -> List[Lease]:
        """The longest present prefix of `keys`, each leased until released."""
        return self._c.lookup_leased(list(keys))

    def lookup_group(self, ranks: Sequence[Sequence[ChunkKey]]) -> GroupPrefix:
        """The prefix every rank of a tensor-parallel group has (rank r's keys in its own
        namespace); nothing leased."""
        chunks, per_rank = self._c.lookup_group([list(r) for r in ranks])
        return GroupPrefix(chunks, per_rank)

    def release(self, leases: Sequence[Lease]) -> List[Outcome]:
        """Releases leases; an outcome per lease (`done`, or why not)."""
        return outcomes(self._c.release(list(leases)))

    def release_deferred(self, leases: Sequence[Lease]) -> None:
        """Releases without waiting for the answer (collected by a later call)."""
        self._c.release_deferred(list(leases))

    def flush(self) -> None:
        """Waits until every deferred request has been answered."""
        self._c.flush()

    def read(self, lease: Lease, out: Any = None) -> Union[bytearray, int]:
        """A leased chunk's bytes: copied into `out` (returns the length) or a new bytearray."""
        if out is None:
            buf = bytearray(lease.len)
            self._read_into(lease, buf)
            return buf
        return self._read_into(lease, out)

    def _read_into(self, lease: Lease, out: Any) -> int:
        return self._c.read_lease(lease, buffer(out, "out"))

    # --- put / get -----------------------------------------------------------------------

    def get_into(self, keys: Sequence[ChunkKey], buffers: Sequence[Any]) -> List[int]:
        """Copies the longest present prefix of `keys` into `buffers` (one per key); returns
        each chunk's length. Leased during the copy, released (deferred) after."""
        if len(buffers) < len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")
        return self._c.get_into(list(keys), [buffer(b, f"buffers[{i}]") for i, b in enumerate(buffers)])

    def get(self, keys: Sequence[ChunkKey]) -> List[bytearray]:
        """The longest present prefix of `keys`, copied into new bytearrays."""
        leases = self.lookup_leased(keys)
        try:
            out = []
            for lease in leases:
                buf = bytearray(lease.len)
                self._read_into(lease, buf)
                out.append(buf)
            return out
        finally:
            if leases:
                self.release_deferred(leases)

    def put(self, items: PutItems) -> List[Outcome]:
        """Stores (key, value) pairs: reserve, copy each value into its slot, commit. An
        outcome per item: `stored`, `already_present`, or the error code's name."""
        keys: List[ChunkKey] = []
        values = []
        for i, (k, v) in enumerate(items):
            keys.append(k)
            values.append(buffer(v, f"value {i}"))
        return outcomes(self._c.put(keys, values))

    def reserve(self, keys: Sequence[ChunkKey], lens: Sequence[int]) -> List[Union[Reserved, Outcome]]:
        """Reserves slots: a `Reserved` per key, or the name of why not."""
        return slots(self._c.reserve(list(keys), list(lens)))

    def write(self, reserved: Reserved, data: Any, offset: int = 0) -> None:
        """Copies `data` into a reservation at `offset`."""
        self._c.write_reserved(reserved, buffer(data, "data"), offset)

    def commit(self, reserved: Sequence[Reserved]) -> List[Outcome]:
        """Makes written reservations visible; an outcome per slot."""
        return outcomes(self._c.commit(list(reserved)))

    def abort(self, reserved: Sequence[Reserved]) -> List[Outcome]:
        """Gives reservations back unwritten."""
        return outcomes(self._c.abort(list(reserved)))

    def evict(self, keys: Sequence[ChunkKey]) -> List[Outcome]:
        """Removes chunks nobody leases; an outcome per key."""
        return outcomes(self._c.evict(list(keys)))

    # --- engine blocks (the engine's process copies) -------------------------------------

    @staticmethod
    def _regions(regions: Sequence[Region]) -> List[Tuple[Any, int, int]]:
        return [
            (buffer(r.buffer, f"region {i}"), r.block_bytes, r.block_stride or r.block_bytes)
            for i, r in enumerate(regions)
        ]

    def save_blocks(self, regions: Sequence[Region], keys: Sequence[ChunkKey],
                    blocks: Sequence[int]) -> List[Outcome]:
        """Saves engine blocks as chunks (chunk i = blocks[i*n:(i+1)*n], n = len(blocks) //
        len(keys)), gathered straight into their slots. An outcome per key."""
        return outcomes(self._c.save_blocks(self._regions(regions), list(keys), list(blocks)))

    def load_blocks(self, regions: Sequence[Region], keys: Sequence[ChunkKey],
                    blocks: Sequence[int]) -> List[Outcome]:
        """Loads the longest present prefix of `keys` into engine blocks: `done` per chunk
        loaded, `not_found` after the first missing one, `invalid_argument` for a chunk of
        another length than its blocks (nothing after it is loaded)."""
        return outcomes(self._c.load_blocks(self._regions(regions), list(keys), list(blocks)))

    def arena(self) -> Optional[ArenaInfo]:
        """This connection's arena (its length, the connection number and each memfd's
        (offset, length) in it: one, or one per shard), None while disconnected."""
        info = self._c.arena()
        return None if info is None else ArenaInfo(*info)

    def host_arena(self) -> ArenaMapping:
        """The arena mapped by this process, as a writable buffer (`numpy.frombuffer`) that
        stays mapped for as long as it or an array made from it lives: the memory chunks are
        copied to and from. Reading a chunk there is safe only while it is leased; writing,
        only into this connection's reservations (check `connection`)."""
        return self._c.host_arena()

    def cuda_arena(self, device: int) -> ArenaMapping:
        """The arena mapped by this process and registered with CUDA device `device` (torch's
        numbering), for an engine that copies between its GPU memory and the slots itself
        (`orbitkv.gpu.EngineCopies`): a buffer (`torch.frombuffer(arena, dtype=torch.uint8)`)
        that stays mapped and registered for as long as it or a tensor made from it lives.
        One per device and connection, shared by this client's users; registering takes
        about 50 ms per GiB of arena. After a reconnect the next call registers the new
        connection's arena; the old one's slots are not to be used (check `connection`)."""
        held = self._cuda_arenas.get(device)
        if held is None or held.connection != self._c.connection:
            self._cuda_arenas.pop(device, None)
            held = self._c.cuda_arena(device)
            self._cuda_arenas[device] = held
        return held

    # --- GPU pages (the server's DMA threads copy) ---------------------------------------

    def register_gpu(self, device_uuid: str, layout: KvLayout, tensors: Sequence[Any]) -> GpuRegistration:
        """Registers an engine rank's KV tensors on GPU `device_uuid` (`GPU-...`): one entry
        per tensor of the layout, each a torch CUDA tensor (shared by CUDA IPC here) or a
        (64-byte handle, offset, length) triple."""
        from .gpu import ipc_triple

        triples = [t if isinstance(t, tuple) else ipc_triple(t) for t in tensors]
        return self._c.register_gpu(device_uuid, layout, triples)

    def unregister_gpu(self, reg: GpuRegistration) -> None:
        self._c.unregister_gpu(reg)

    def save(self, reg: GpuRegistration, keys: Sequence[ChunkKey], blocks: Sequence[int]) -> List[Outcome]:
        """Engine blocks -> new chunks, copied by the server. An outcome per key."""
        return outcomes(self._c.save(reg, list(keys), list(blocks)))

    def load(self, reg: GpuRegistration, keys: Sequence[ChunkKey], blocks: Sequence[int]) -> List[Outcome]:
        """Chunks -> engine blocks (longest present prefix), copied by the server."""
        return outcomes(self._c.load(reg, list(keys), list(blocks)))

    def start_save(self, reg: GpuRegistration, keys: Sequence[ChunkKey], blocks: Sequence[int]) -> Transfer:
        return self._c.start_save(reg, list(keys), list(blocks))

    def start_load(self, reg: GpuRegistration, keys: Sequence[ChunkKey], blocks: Sequence[int]) -> Transfer:
        return self._c.start_load(reg, list(keys), list(blocks))

    def poll_transfer(self, t: Transfer) -> Optional[List[Outcome]]:
        return maybe_outcomes(self._c.poll_transfer(t))

    def wait_transfer(self, t: Transfer) -> List[Outcome]:
        return outcomes(self._c.wait_transfer(t))
