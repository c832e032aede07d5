"""A pure-Python stand-in for `orbitkv._native.NativeClient`, for unit tests of the engine
integrations without an `orbitkv-server` process.

`FakeManager` is the Manager: chunks in a dict, leases, the sessions of its clients, a record of
every call, and fault switches a test flips (`stop`/`start`, `hold`, `fail_load`,
`refuse_saves`). `FakeNativeClient` is one client of it, with the native client's calls and
semantics: the longest present prefix for lookups, leases that must be released (exactly once,
in the session that took them), `save_blocks` gathering engine blocks into chunks and
`load_blocks` scattering the longest present prefix back, with the outcome names the native
module returns. Buffers are objects with the buffer protocol, as the native layer takes them
(regions are `(buffer, block_bytes, block_stride)`).

The plain values are the real compiled ones (`ChunkKey`, `NamespaceDescriptor`, the errors,
`chunk_checksum`); leases, reservations and hits cannot be built from Python, so `FakeLease`,
`FakeReserved` and `FakeHit` carry the same attributes. `install(monkeypatch)` makes
`orbitkv.Client` build fake clients of a new `FakeManager`.

What the fake does not model: reconnect backoff (every call while the Manager is away is a
connect attempt), tiers other than DRAM, eviction under pressure, and GPU registrations.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Type

from orbitkv import _native
from orbitkv._native import (
    ChunkKey,
    Disconnected,
    InvalidArgument,
    NamespaceDescriptor,
    OrbitKVError,
    ServerError,
    Stale,
    Timeout,
    Unavailable,
    chunk_checksum,
)

#: The outcome names a batch call can answer.
OUTCOMES = frozenset(_native.OUTCOMES)

#: The Manager's largest chunk (its `--max-chunk-size` default), answered by register_namespace.
MAX_CHUNK_BYTES = 256 << 20

#: How long a held call waits for its gate before it fails as the native's request timeout.
GATE_TIMEOUT = 30.0


def error(cls: Type[OrbitKVError], kind: str, message: str, code: Optional[str] = None) -> OrbitKVError:
    """An exception of the native module's class, with `kind` and `code` set as it sets them."""
    e = cls(message)
    e.kind = kind  # type: ignore[attr-defined]
    e.code = code  # type: ignore[attr-defined]
    return e


def invalid(message: str) -> OrbitKVError:
    return error(InvalidArgument, "invalid_argument", message)


@dataclasses.dataclass(frozen=True, eq=False)
class FakeLease:
    """A lease: the chunk stays readable until released. Compared by identity (two lookups of
    one key are two leases)."""

    key: ChunkKey
    len: int
    tier: str
    checksum: int
    offset: int
    connection: int
    client: str

    def __len__(self) -> int:
        return self.len


@dataclasses.dataclass(frozen=True, eq=False)
class FakeReserved:
    key: ChunkKey
    len: int
    offset: int
    connection: int

    def __len__(self) -> int:
        return self.len


@dataclasses.dataclass(frozen=True)
class FakeHit:
    len: int
    tier: str
    checksum: int


@dataclasses.dataclass(frozen=True)
class Call:
    """One call a client made that reached the Manager: its keys, blocks and outcomes."""

    client: str
    op: str
    keys: Tuple[ChunkKey, ...]
    blocks: Tuple[int, ...] = ()
    outcomes: Tuple[str, ...] = ()


class Gate:
    """Holds the calls of one kind (`FakeManager.hold`) until `open`: a slow or stopped Manager
    for those calls. A call held past `GATE_TIMEOUT` fails as the request timeout would."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = False
        self.waiting = 0
        self.passed = 0

    def pass_through(self) -> None:
        with self._cond:
            self.waiting += 1
            self._cond.notify_all()
            opened = self._cond.wait_for(lambda: self._open, GATE_TIMEOUT)
            self.waiting -= 1
            self.passed += 1
        if not opened:
            raise error(Timeout, "timeout", f"no answer in {GATE_TIMEOUT:g} s (a test never opened its gate)")

    def wait_entered(self, n: int = 1, timeout: float = 10.0) -> None:
        """Returns once `n` calls are held here (fails the test after `timeout`: a hang guard)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.waiting >= n, timeout):
                raise AssertionError(f"{n} call(s) never reached the gate ({self.waiting} did)")

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()


class FakeManager:
    """The Manager the fake clients share (see the module docs)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.chunks: Dict[ChunkKey, bytes] = {}
        self._offsets: Dict[ChunkKey, int] = {}
        self._next_offset = 0
        #: Namespaces registered by any session.
        self.namespaces: Dict[int, NamespaceDescriptor] = {}
        self.clients: List["FakeNativeClient"] = []
        self.calls: List[Call] = []
        self.up = True
        #: Bumped when the Manager stops: every session before it has ended.
        self.boot = 1
        self._next_session = 1
        self._connections = itertools.count(1)
        self._leases: Dict[int, FakeLease] = {}
        self._reserved: Dict[int, FakeReserved] = {}
        #: Releases of leases not held (released already): each a description.
        self.bad_releases: List[str] = []
        #: Leases the Manager dropped because their session ended.
        self.dropped_leases = 0
        self._gates: Dict[str, Gate] = {}
        self._load_faults: Dict[ChunkKey, str] = {}
        self._save_refusal: Optional[str] = None

    # ---- fault switches

    def stop(self) -> None:
        """The Manager goes away: open sessions end (their leases and reservations with them);
        a client that had one gets `Disconnected` at its next call, then `Unavailable` until
        `start`. Chunks are kept (as an SSD tier would keep them)."""
        with self._lock:
            self.up = False
            self.boot += 1
            self._next_session = 1
            self.dropped_leases += len(self._leases)
            self._leases.clear()
            self._reserved.clear()

    def start(self) -> None:
        with self._lock:
            self.up = True

    def hold(self, op: str) -> Gate:
        """Holds every `op` call (`lookup`, `save` or `load`) at a gate until it is opened."""
        assert op in ("lookup", "save", "load"), op
        gate = Gate()
        with self._lock:
            self._gates[op] = gate
        return gate

    def fail_load(self, key: ChunkKey, outcome: str = "invalid_argument") -> None:
        """`load_blocks` answers `outcome` for `key` (as for a chunk of another length than its
        blocks) and loads nothing after it."""
        assert outcome in OUTCOMES and outcome != "done", outcome
        with self._lock:
            self._load_faults[key] = outcome

    def refuse_saves(self, outcome: Optional[str]) -> None:
        """New chunks are refused with `outcome` (`no_space`: a full Manager); None: stored."""
        assert outcome is None or outcome in OUTCOMES, outcome
        with self._lock:
            self._save_refusal = outcome

    # ---- what tests read

    def store(self, key: ChunkKey, data: bytes) -> None:
        """Puts a chunk as another process would have saved it (no session, no record)."""
        with self._lock:
            self._commit(key, bytes(data))

    def leases_held(self, client: Optional[str] = None) -> int:
        with self._lock:
            return sum(1 for lease in self._leases.values() if client is None or lease.client == client)

    def reservations_open(self) -> int:
        with self._lock:
            return len(self._reserved)

    def recorded(self, op: str, client: Optional[str] = None) -> List[Call]:
        with self._lock:
            return [c for c in self.calls if c.op == op and (client is None or c.client == client)]

    def keys_with(self, op: str, outcome: str, client: Optional[str] = None) -> List[ChunkKey]:
        """Every key a call of `op` answered `outcome` for, in order."""
        return [k for c in self.recorded(op, client) for k, o in zip(c.keys, c.outcomes) if o == outcome]

    def client(self, name: str) -> "FakeNativeClient":
        (c,) = [c for c in self.clients if c.name == name]
        return c

    def assert_quiet(self) -> None:
        """Nothing left behind: no lease held, none released twice, no open reservation, no
        call held at a gate."""
        with self._lock:
            held = [(lease.client, lease.key.digest.hex()[:8]) for lease in self._leases.values()]
            gates = {op: g.waiting for op, g in self._gates.items() if g.waiting}
        assert not held, f"leases never released: {held}"
        assert not self.bad_releases, f"leases released twice: {self.bad_releases}"
        assert not self.reservations_open(), "reservations never committed or aborted"
        assert not gates, f"calls still held: {gates}"

    # ---- for the clients (under the lock)

    def _commit(self, key: ChunkKey, data: bytes) -> None:
        self.chunks[key] = data
        self._offsets[key] = self._next_offset
        self._next_offset += max(len(data), 1)

    def _gate(self, op: str) -> None:
        with self._lock:
            gate = self._gates.get(op)
        if gate is not None:
            gate.pass_through()

    def _lease(self, key: ChunkKey, connection: int, client: str) -> FakeLease:
        data = self.chunks[key]
        lease = FakeLease(key, len(data), "dram", chunk_checksum(data), self._offsets[key], connection, client)
        self._leases[id(lease)] = lease
        return lease

    def _release(self, lease: FakeLease) -> str:
        if self._leases.pop(id(lease), None) is None:
            self.bad_releases.append(f"{lease.client}: {lease.key.digest.hex()[:8]}")
            return "not_found"
        return "done"

    def _prefix(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.chunks:
            n += 1
        return n


def _region_args(regs: Any, write: bool) -> List[Tuple[memoryview, int, int]]:
    """The `(buffer, block_bytes, block_stride)` regions, held as the native layer holds them."""
    out = []
    for i, r in enumerate(regs):
        if not (isinstance(r, tuple) and len(r) == 3):
            raise TypeError(f"argument 'regs': region {i} is not a (buffer, block_bytes, block_stride) tuple "
                            f"(a {type(r).__name__} of {len(r) if isinstance(r, tuple) else '?'})")
        buf, block_bytes, block_stride = r
        for name, v in (("block_bytes", block_bytes), ("block_stride", block_stride)):
            if not isinstance(v, int) or v < 0:
                raise TypeError(f"argument 'regs': region {i}'s {name} {v!r} is not an unsigned integer")
        out.append((_held(buf, write, f"region {i}"), block_bytes, block_stride))
    if write:
        _no_overlap([m for m, _, _ in out], lambda i: f"region {i}")
    return out


def _held(obj: Any, write: bool, what: str) -> memoryview:
    """`obj`'s bytes: refused as the native layer refuses them (`InvalidArgument` naming `what`)."""
    try:
        view = memoryview(obj)
    except TypeError:
        raise invalid(f"{what} of type {type(obj).__name__} has no buffer protocol (bytes, bytearray, "
                      "memoryview, numpy array or CPU torch tensor)") from None
    if not view.c_contiguous:
        raise invalid(f"{what} is not C-contiguous")
    if write and view.readonly:
        raise invalid(f"{what} is read-only ({type(obj).__name__}); pass a writable buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _no_overlap(views: List[memoryview], name: Any) -> None:
    spans = []
    for i, v in enumerate(views):
        if v.nbytes:
            spans.append((ctypes.addressof(ctypes.c_char.from_buffer(v)), v.nbytes, i))
    spans.sort()
    for (a, n, i), (b, _, j) in zip(spans, spans[1:]):
        if a + n > b:
            i, j = min(i, j), max(i, j)
            raise invalid(f"{name(i)} and {name(j)} overlap: each buffer written by one call must be its own memory")


def _u64s(values: Any, what: str) -> List[int]:
    out = list(values)
    for v in out:
        if not isinstance(v, int) or v < 0:
            raise OverflowError(f"argument '{what}': {v!r} is not an unsigned integer")
    return out


def _check_blocks(regions: List[Tuple[memoryview, int, int]], keys: List[ChunkKey], blocks: List[int]) -> int:
    """The native client's checks of a block call; the blocks per chunk."""
    if not regions:
        raise invalid("no regions: give at least one")
    if not keys or not blocks or len(blocks) % len(keys):
        raise invalid(f"{len(blocks)} block ids for {len(keys)} keys: give the same number (at least one) per key")
    for r, (view, block_bytes, stride) in enumerate(regions):
        if block_bytes == 0 or stride < block_bytes:
            raise invalid(f"region {r}: block_bytes {block_bytes} and block_stride {stride}: a block has bytes "
                          "and fits its stride")
        bad = next((b for b in blocks if b * stride + block_bytes > view.nbytes), None)
        if bad is not None:
            raise invalid(f"block {bad} lies outside region {r} ({view.nbytes} bytes, {stride} per block)")
    return len(blocks) // len(keys)


class FakeNativeClient:
    """One client of a `FakeManager`, with `_native.NativeClient`'s constructor and calls."""

    def __init__(
        self,
        manager: FakeManager,
        socket: Optional[str] = None,
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
        for what, v in (("request_timeout", request_timeout), ("reconnect_backoff", reconnect_backoff),
                        ("reconnect_backoff_max", reconnect_backoff_max)):
            if not (0 < v <= 86400):
                raise invalid(f"{what} = {v}: seconds, above 0 and at most a day")
        self.manager = manager
        self.socket = os.fspath(socket) if socket is not None else "/run/orbitkv/fake.sock"
        self.name = name
        self.request_timeout = request_timeout
        self._call = threading.Lock()  # the native client's calls are serialized
        self._boot: Optional[int] = None  # the Manager's boot of the open session
        self.session_id: Optional[int] = None
        self.connection: Optional[int] = None
        self.connect_attempts = 0
        self.deferred_failures = 0
        #: Namespaces registered through this client: every session registers them again.
        self._namespaces: Dict[int, NamespaceDescriptor] = {}
        self._session_ns: Set[int] = set()
        #: The bytes written into each open reservation, committed as the chunk.
        self._pending: Dict[int, bytearray] = {}
        with manager._lock:
            manager.clients.append(self)
        if connect:
            with self._call:
                self._session()

    @property
    def is_connected(self) -> bool:
        return self._boot is not None

    # ---- the session

    def _session(self) -> None:
        """Opens a session if none is open (registering this client's namespaces); raises as the
        native client does when the Manager cannot be reached or the session ended."""
        m = self.manager
        with m._lock:
            if self._boot is not None and (not m.up or self._boot != m.boot):
                self._end()
                raise error(Disconnected, "disconnected", "the session ended (the Manager stopped)")
            if self._boot is not None:
                return
            self.connect_attempts += 1
            if not m.up:
                raise error(Unavailable, "connect", f"cannot connect to {self.socket}: the Manager is not running")
            self._boot = m.boot
            self.session_id = m._next_session
            m._next_session += 1
            self.connection = next(m._connections)
            self.deferred_failures = 0
            self._session_ns = set()
            for d in self._namespaces.values():
                m.namespaces[d.id] = d
                self._session_ns.add(d.id)

    def _end(self) -> None:
        self._boot = self.session_id = self.connection = None

    def _check_namespaces(self, keys: Sequence[ChunkKey]) -> None:
        for k in keys:
            if k.namespace not in self._session_ns:
                raise error(ServerError, "unknown_namespace",
                            f"namespace {k.namespace:#018x} is not registered by this session: register it first",
                            "unknown_namespace")

    def _record(self, op: str, keys: Sequence[ChunkKey], blocks: Sequence[int] = (),
                outcomes: Sequence[str] = ()) -> None:
        assert set(outcomes) <= OUTCOMES, f"the fake answered outcomes the native never does: {outcomes}"
        self.manager.calls.append(Call(self.name, op, tuple(keys), tuple(blocks), tuple(outcomes)))

    # ---- calls

    def ping(self) -> None:
        with self._call:
            self._session()

    def register_namespace(self, descriptor: NamespaceDescriptor) -> Tuple[int, int]:
        with self._call:
            self._namespaces[descriptor.id] = descriptor  # remembered even when unreachable
            self._session()
            with self.manager._lock:
                self.manager.namespaces[descriptor.id] = descriptor
                self._session_ns.add(descriptor.id)
            return descriptor.id, MAX_CHUNK_BYTES

    def _leased(self, op: str, ks: List[ChunkKey]) -> List[FakeLease]:
        """Under the call lock: the longest present prefix of `ks`, leased."""
        self._session()
        self._check_namespaces(ks)
        m = self.manager
        if op == "lookup":
            m._gate("lookup")
        with m._lock:
            if self._boot != m.boot:
                self._end()
                raise error(Disconnected, "disconnected", "the session ended during the call")
            leases = [m._lease(k, self.connection or 0, self.name) for k in ks[:m._prefix(ks)]]
            if op == "lookup":
                self._record("lookup_leased", ks, outcomes=["done"] * len(leases))
        return leases

    def lookup(self, ks: List[ChunkKey]) -> List[FakeHit]:
        with self._call:
            self._session()
            self._check_namespaces(ks)
            self.manager._gate("lookup")
            with self.manager._lock:
                n = self.manager._prefix(ks)
                self._record("lookup", ks, outcomes=["done"] * n)
                return [FakeHit(len(d), "dram", chunk_checksum(d)) for d in (self.manager.chunks[k] for k in ks[:n])]

    def lookup_leased(self, ks: List[ChunkKey]) -> List[FakeLease]:
        with self._call:
            return self._leased("lookup", list(ks))

    def lookup_group(self, ranks: List[List[ChunkKey]]) -> Tuple[int, List[int]]:
        with self._call:
            self._session()
            for r in ranks:
                self._check_namespaces(r)
            with self.manager._lock:
                per_rank = [self.manager._prefix(r) for r in ranks]
            return (min(per_rank) if per_rank else 0), per_rank

    def _stale(self, leases: Sequence[Any]) -> bool:
        return any(getattr(lease, "connection", None) != self.connection for lease in leases)

    def release(self, leases: List[FakeLease]) -> List[str]:
        with self._call:
            self._session()
            if self._stale(leases):
                raise error(Stale, "stale", "a lease of an earlier session")
            with self.manager._lock:
                out = [self.manager._release(lease) for lease in leases]
                self._record("release", [lease.key for lease in leases], outcomes=out)
            return out

    def release_deferred(self, leases: List[FakeLease]) -> None:
        """As the native: never connects; leases of another session are `Stale`; a lease not
        held is a failure counted in `deferred_failures` (and in the Manager's `bad_releases`)."""
        with self._call:
            m = self.manager
            with m._lock:
                if self._boot is not None and (not m.up or self._boot != m.boot):
                    self._end()  # the session's socket is closed: noticed here
                if leases and (self._boot is None or self._stale(leases)):
                    raise error(Stale, "stale", "a lease of an earlier session")
                out = [m._release(lease) for lease in leases]
                self.deferred_failures += sum(1 for o in out if o != "done")
                if leases:
                    self._record("release_deferred", [lease.key for lease in leases], outcomes=out)

    def flush(self) -> None:
        with self._call:
            m = self.manager
            with m._lock:
                if self._boot is not None and (not m.up or self._boot != m.boot):
                    self._end()
                    raise error(Disconnected, "disconnected", "the session ended (the Manager stopped)")

    def read_lease(self, lease: FakeLease, out: Any) -> int:
        view = _held(out, True, "out")
        with self._call:
            if lease.connection != self.connection or self._boot != self.manager.boot:
                raise error(Stale, "stale", "a lease of an earlier session")
            with self.manager._lock:
                if id(lease) not in self.manager._leases:
                    raise error(Stale, "stale", "a lease released already")
                data = self.manager.chunks[lease.key]
            if view.nbytes < len(data):
                raise error(InvalidArgument, "buffer_too_small", f"needed {len(data)} bytes, got {view.nbytes}")
            view[:len(data)] = data
            return len(data)

    def get_into(self, ks: List[ChunkKey], buffers: List[Any]) -> List[int]:
        views = [_held(b, True, f"buffers[{i}]") for i, b in enumerate(buffers)]
        _no_overlap(views, lambda i: f"buffers[{i}]")
        with self._call:
            leases = self._leased("get", list(ks))
            with self.manager._lock:
                try:
                    for lease, view in zip(leases, views):
                        if view.nbytes < lease.len:
                            raise error(InvalidArgument, "buffer_too_small",
                                        f"needed {lease.len} bytes, got {view.nbytes}")
                        view[:lease.len] = self.manager.chunks[lease.key]
                finally:
                    for lease in leases:
                        self.manager._release(lease)
            return [lease.len for lease in leases]

    def _put(self, op: str, ks: List[ChunkKey], chunks: Any, blocks: Sequence[int] = ()) -> List[str]:
        """Under the call lock: stores each new chunk (`chunks(i)` its bytes); an outcome per key."""
        self._session()
        self._check_namespaces(ks)
        m = self.manager
        m._gate("save" if op == "save_blocks" else "put")
        with m._lock:
            if self._boot != m.boot:
                self._end()
                raise error(Disconnected, "disconnected", "the session ended during the call")
            out = []
            for i, k in enumerate(ks):
                if k in m.chunks:
                    out.append("already_present")
                    continue
                data = chunks(i)
                if len(data) > MAX_CHUNK_BYTES:
                    out.append("too_large")
                elif m._save_refusal is not None:
                    out.append(m._save_refusal)
                else:
                    m._commit(k, data)
                    out.append("stored")
            self._record(op, ks, blocks, out)
        return out

    def put(self, ks: List[ChunkKey], buffers: List[Any]) -> List[str]:
        if len(ks) != len(buffers):
            raise invalid(f"{len(ks)} keys but {len(buffers)} values")
        views = [_held(b, False, f"value {i}") for i, b in enumerate(buffers)]
        with self._call:
            return self._put("put", list(ks), lambda i: views[i].tobytes())

    def reserve(self, ks: List[ChunkKey], lens: List[int]) -> List[Any]:
        with self._call:
            self._session()
            self._check_namespaces(ks)
            out: List[Any] = []
            with self.manager._lock:
                for k, n in zip(ks, _u64s(lens, "lens")):
                    if k in self.manager.chunks:
                        out.append("already_present")
                    elif self.manager._save_refusal is not None:
                        out.append(self.manager._save_refusal)
                    else:
                        r = FakeReserved(k, n, 0, self.connection or 0)
                        self.manager._reserved[id(r)] = r
                        out.append(r)
            for r in out:
                if isinstance(r, FakeReserved):
                    self._pending[id(r)] = bytearray(r.len)
            return out

    def write_reserved(self, reserved: FakeReserved, data: Any, offset: int = 0) -> None:
        view = _held(data, False, "data")
        with self._call:
            slot = self._pending.get(id(reserved))
            if slot is None or reserved.connection != self.connection:
                raise error(Stale, "stale", "a reservation of an earlier session")
            if offset + view.nbytes > len(slot):
                raise invalid(f"{view.nbytes} bytes at offset {offset} do not fit the {len(slot)}-byte reservation")
            slot[offset:offset + view.nbytes] = view

    def _settle(self, slots: List[FakeReserved], commit: bool) -> List[str]:
        with self._call:
            self._session()
            if any(r.connection != self.connection for r in slots):
                raise error(Stale, "stale", "a reservation of an earlier session")
            out = []
            with self.manager._lock:
                for r in slots:
                    data = self._pending.pop(id(r), None)
                    if self.manager._reserved.pop(id(r), None) is None or data is None:
                        out.append("not_found")
                        continue
                    if commit:
                        self.manager._commit(r.key, bytes(data))
                    out.append("done")
                self._record("commit" if commit else "abort", [r.key for r in slots], outcomes=out)
            return out

    def commit(self, slots: List[FakeReserved]) -> List[str]:
        return self._settle(list(slots), True)

    def abort(self, slots: List[FakeReserved]) -> List[str]:
        return self._settle(list(slots), False)

    def evict(self, ks: List[ChunkKey]) -> List[str]:
        with self._call:
            self._session()
            self._check_namespaces(ks)
            out = []
            with self.manager._lock:
                leased = {lease.key for lease in self.manager._leases.values()}
                for k in ks:
                    if k not in self.manager.chunks:
                        out.append("not_found")
                    elif k in leased:
                        out.append("busy")
                    else:
                        del self.manager.chunks[k]
                        out.append("done")
                self._record("evict", ks, outcomes=out)
            return out

    def save_blocks(self, regs: List[Any], ks: List[ChunkKey], blocks: List[int]) -> List[str]:
        """Gathers engine blocks into chunks: chunk i is, region by region, the bytes of
        `blocks[i*n:(i+1)*n]`. An outcome per key."""
        regions = _region_args(regs, write=False)
        ks, blocks = list(ks), _u64s(blocks, "blocks")
        per_chunk = _check_blocks(regions, ks, blocks)

        def gather(i: int) -> bytes:
            chunk = blocks[i * per_chunk:(i + 1) * per_chunk]
            return b"".join(view[b * stride:b * stride + bb].tobytes()
                            for view, bb, stride in regions for b in chunk)

        with self._call:
            return self._put("save_blocks", ks, gather, blocks)

    def load_blocks(self, regs: List[Any], ks: List[ChunkKey], blocks: List[int]) -> List[str]:
        """Scatters the longest present prefix of `ks` into engine blocks: `done` per chunk
        loaded, `not_found` after the first missing one, `invalid_argument` for a chunk of
        another length than its blocks (or the outcome `fail_load` set), nothing after it."""
        regions = _region_args(regs, write=True)
        ks, blocks = list(ks), _u64s(blocks, "blocks")
        per_chunk = _check_blocks(regions, ks, blocks)
        dup = next((b for b in blocks if blocks.count(b) > 1), None)
        if dup is not None:
            raise invalid(f"block {dup} named twice: a load writes each block once")
        length = sum(bb * per_chunk for _, bb, _ in regions)
        with self._call:
            leases = self._leased("load", ks)
            self.manager._gate("load")
            m = self.manager
            with m._lock:
                out = ["not_found"] * len(ks)
                usable = len(leases)
                for i, lease in enumerate(leases):
                    fault = m._load_faults.get(lease.key)
                    if fault is not None or lease.len != length:
                        out[i] = fault or "invalid_argument"
                        usable = i
                        break
                for i, lease in enumerate(leases[:usable]):
                    data, at = m.chunks[lease.key], 0
                    for view, bb, stride in regions:
                        for b in blocks[i * per_chunk:(i + 1) * per_chunk]:
                            view[b * stride:b * stride + bb] = data[at:at + bb]
                            at += bb
                    out[i] = "done"
                for lease in leases:
                    m._release(lease)
                self._record("load_blocks", ks, blocks, out)
            return out

    def arena(self) -> None:
        """No arena to map: the fake's chunks are not in shared memory."""
        return None

    def __getattr__(self, name: str) -> Any:
        if name in ("register_gpu", "unregister_gpu", "save", "load", "start_save", "start_load",
                    "poll_transfer", "wait_transfer"):
            raise NotImplementedError(f"FakeNativeClient has no GPU calls ({name})")
        raise AttributeError(name)


def install(monkeypatch: Any, manager: Optional[FakeManager] = None) -> FakeManager:
    """Makes every `orbitkv.Client` built from now on (until the test ends) a client of
    `manager` (a new `FakeManager` by default), and returns the manager."""
    import orbitkv.client

    manager = manager if manager is not None else FakeManager()

    def native_client(*args: Any, **kwargs: Any) -> FakeNativeClient:
        return FakeNativeClient(manager, *args, **kwargs)

    monkeypatch.setattr(orbitkv.client._native, "NativeClient", native_client)
    return manager
