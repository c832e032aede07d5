"""The `orbitkv` package against a real Manager: round trips of every buffer kind, leases,
typed errors, reservations, groups, engine blocks, restart and reconnect, client death."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import orbitkv
import pytest
from conftest import REPO, Server, wait_until
from orbitkv import ChunkKey, Client, NamespaceDescriptor, Region


def descriptor(model: str = "test/model", **kw) -> NamespaceDescriptor:
    args = dict(model=model, dtype="fp32", num_layers=1, num_kv_heads=1, head_dim=512, tokens_per_chunk=16)
    args.update(kw)
    return NamespaceDescriptor(**args)


def chain(ns: int, n: int, seed: int = 0):
    tokens = [(t * 2654435761 + seed) % 2**32 for t in range(16 * n)]
    return [ChunkKey(ns, d) for d in orbitkv.prefix_digests(tokens, 16)]


def value(i: int, n: int = 4096) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def client(server):
    c = Client(server.socket, name="pytest")
    return c


def test_put_get_round_trips_every_buffer_kind(client, server):
    ns = client.register_namespace(descriptor())
    keys = chain(ns.id, 5)
    arr = np.frombuffer(value(3), dtype=np.float32).reshape(32, 32)
    values = [value(0), bytearray(value(1)), memoryview(value(2)), arr]
    # CPU torch tensors where torch is installed (scripts/test runs this file in the vLLM venv
    # too, with ORBITKV_REQUIRE_TORCH=1, so that they are always covered).
    if os.environ.get("ORBITKV_REQUIRE_TORCH"):
        import torch
    else:
        torch = None if importlib.util.find_spec("torch") is None else __import__("torch")
    if torch is not None:
        values.append(torch.frombuffer(bytearray(value(4)), dtype=torch.bfloat16).reshape(8, -1))
    out = client.put(list(zip(keys, values)))
    assert out == ["stored"] * len(values)
    assert client.put([(keys[0], value(0))]) == ["already_present"]
    want = [value(i) for i in range(len(values))]
    assert [bytes(b) for b in client.get(keys)] == want
    # Into caller buffers: bytearray, numpy, memoryview of a bytearray.
    bufs = [bytearray(4096), np.zeros(4096, np.uint8), memoryview(bytearray(4096)), np.zeros((32, 32), np.float32)]
    if torch is not None:
        bufs.append(torch.zeros(2048, dtype=torch.bfloat16))
    lens = client.get_into(keys[:len(bufs)], bufs)
    assert lens == [4096] * len(bufs)
    assert bytes(bufs[0]) == want[0] and bufs[1].tobytes() == want[1]
    assert bytes(bufs[2]) == want[2] and bufs[3].tobytes() == want[3]
    if torch is not None:
        assert bufs[4].view(torch.uint8).numpy().tobytes() == want[4]
        with pytest.raises(orbitkv.InvalidArgument, match="non-contiguous"):
            client.get_into(keys[:1], [torch.zeros(64, 64, dtype=torch.uint8)[:, ::2]])
    client.flush()
    assert server.shard_sum("leases") == 0


def test_outcomes_are_one_enum_shared_with_the_native_module(client):
    assert sorted(o.value for o in orbitkv.Outcome) == sorted(orbitkv._native.OUTCOMES)
    ns = client.register_namespace(descriptor())
    key = chain(ns.id, 1)
    out = client.put([(key[0], value(0))]) + client.put([(key[0], value(0))])
    assert out == [orbitkv.Outcome.STORED, orbitkv.Outcome.ALREADY_PRESENT] == ["stored", "already_present"]
    assert all(isinstance(o, orbitkv.Outcome) and o.ok for o in out)
    assert client.reserve(key, [4096]) == [orbitkv.Outcome.ALREADY_PRESENT]
    (miss,) = client.evict(chain(ns.id, 2)[1:])
    assert miss is orbitkv.Outcome.NOT_FOUND and not miss.ok and f"{miss}" == "not_found"


def test_leases_pin_until_released_and_lookup_is_a_prefix(client, server):
    ns = client.register_namespace(descriptor())
    keys = chain(ns.id, 4)
    client.put([(k, value(i)) for i, k in enumerate(keys[:2])])
    assert [h.len for h in client.lookup(keys)] == [4096, 4096]
    assert client.lookup(keys)[0].tier == "dram"
    leases = client.lookup_leased(keys)
    assert len(leases) == 2 and leases[0].key == keys[0] and len(leases[1]) == 4096
    assert server.shard_sum("leases") == 2
    # A leased chunk cannot be evicted.
    assert client.evict(keys[:1]) == ["busy"]
    out = bytearray(4096)
    assert client.read(leases[1], out) == 4096 and bytes(out) == value(1)
    assert bytes(client.read(leases[0])) == value(0)
    assert client.release(leases) == ["done", "done"]
    assert server.shard_sum("leases") == 0
    assert client.evict(keys[:1]) == ["done"]
    assert len(client.lookup(keys)) == 0


def test_typed_errors_carry_kind_and_code(client, server):
    ns = client.register_namespace(descriptor())
    keys = chain(ns.id, 2)
    with pytest.raises(orbitkv.InvalidArgument) as e:
        NamespaceDescriptor(model="m", dtype="int3", num_layers=1, num_kv_heads=1, head_dim=1, tokens_per_chunk=1)
    assert "int3" in str(e.value) and e.value.kind == "invalid_argument"
    with pytest.raises(orbitkv.InvalidArgument, match="head_dim"):
        descriptor(head_dim=0)
    with pytest.raises(orbitkv.InvalidArgument, match="32 bytes"):
        ChunkKey(1, b"short")
    with pytest.raises(orbitkv.InvalidArgument, match="read-only"):
        client.get_into(keys[:1], [b"\0" * 4096])
    with pytest.raises(orbitkv.InvalidArgument, match="no buffer protocol"):
        client.put([(keys[0], "a str")])
    with pytest.raises(orbitkv.InvalidArgument, match="not C-contiguous"):
        client.put([(keys[0], np.zeros((64, 64), np.uint8)[:, ::2])])
    # Larger than the namespace's chunks: the server's refusal, per key.
    big = bytes(ns.max_chunk_bytes + 1)
    assert client.put([(keys[0], big)]) == ["too_large"]
    # A namespace this session did not register: the server refuses the request, naming it.
    stranger = ChunkKey(12345, bytes(32))
    with pytest.raises(orbitkv.ServerError, match="not registered by this session") as e:
        client.put([(stranger, b"x" * 10)])
    assert e.value.code == "unknown_namespace"
    # The server goes on serving.
    client.ping()
    assert issubclass(orbitkv.Timeout, orbitkv.Disconnected)
    assert all(issubclass(c, orbitkv.OrbitKVError) for c in
               (orbitkv.Unavailable, orbitkv.Stale, orbitkv.ServerError, orbitkv.ProtocolError))


def test_the_native_layer_holds_buffers_and_takes_no_addresses(client, server):
    """`orbitkv._native` called directly: an integer is not memory, and one call's writable
    buffers may not overlap; each refusal names the argument and the server goes on."""
    ns = client.register_namespace(descriptor())
    keys = chain(ns.id, 2)
    assert client.put([(k, value(i)) for i, k in enumerate(keys)]) == ["stored", "stored"]
    native = client._c
    with pytest.raises(orbitkv.InvalidArgument, match=r"buffers\[0\] of type int has no buffer protocol"):
        native.get_into(keys[:1], [0x7F0000000000])
    with pytest.raises(orbitkv.InvalidArgument, match="region 0 of type int has no buffer protocol"):
        native.load_blocks([(0x7F0000000000, 4096, 4096)], keys[:1], [0])
    slot = client.reserve(chain(ns.id, 3)[2:], [4096])[0]
    with pytest.raises(orbitkv.InvalidArgument, match="data of type int"):
        native.write_reserved(slot, 4096)
    assert client.abort([slot]) == ["done"]
    lease = client.lookup_leased(keys[:1])[0]
    with pytest.raises(orbitkv.InvalidArgument, match="out is read-only"):
        native.read_lease(lease, b"\0" * 4096)
    assert client.release([lease]) == ["done"]
    # Two writable views of one bytearray in one call would be aliased writes: refused.
    buf = bytearray(8192)
    with pytest.raises(orbitkv.InvalidArgument, match=r"buffers\[0\] and buffers\[1\] overlap"):
        native.get_into(keys, [memoryview(buf)[:4096], memoryview(buf)[2048:6144]])
    with pytest.raises(orbitkv.InvalidArgument, match="region 0 and region 1 overlap"):
        native.load_blocks([(buf, 4096, 4096), (buf, 4096, 4096)], keys[:1], [0])
    assert bytes(buf) == bytes(8192)
    # Its disjoint halves are two buffers.
    assert native.get_into(keys, [memoryview(buf)[:4096], memoryview(buf)[4096:]]) == [4096, 4096]
    assert bytes(buf) == value(0) + value(1)
    # The bytearray is exported only during a call: afterwards it resizes again.
    buf.extend(b"x")
    client.flush()
    assert server.shard_sum("leases") == 0 and server.shard_sum("reservations") == 0


def test_reserve_write_commit_and_abort(client, server):
    ns = client.register_namespace(descriptor())
    keys = chain(ns.id, 3)
    slots = client.reserve(keys, [4096, 4096, 4096])
    assert all(isinstance(s, orbitkv.Reserved) for s in slots)
    data = value(7)
    client.write(slots[0], data[:1000])
    client.write(slots[0], data[1000:], offset=1000)
    with pytest.raises(orbitkv.InvalidArgument, match="do not fit"):
        client.write(slots[1], data, offset=1)
    client.write(slots[1], data)
    assert client.commit(slots[:2]) == ["done", "done"]
    assert client.abort(slots[2:]) == ["done"]
    assert client.reserve(keys[:1], [4096]) == ["already_present"]
    assert [bytes(b) for b in client.get(keys)] == [data, data]
    assert server.shard_sum("reservations") == 0


def test_lookup_group_answers_the_prefix_every_rank_has(client):
    r0 = client.register_namespace(descriptor(tp_rank=0, tp_world_size=2))
    r1 = client.register_namespace(descriptor(tp_rank=1, tp_world_size=2))
    k0, k1 = chain(r0.id, 4), chain(r1.id, 4)
    client.put([(k, value(i)) for i, k in enumerate(k0[:3])])
    client.put([(k, value(i)) for i, k in enumerate(k1[:2])])
    g = client.lookup_group([k0, k1])
    assert (g.chunks, g.per_rank) == (2, [3, 2])
    with pytest.raises(orbitkv.InvalidArgument, match="same namespace"):
        client.lookup_group([k0, k0])


def test_engine_blocks_saved_and_loaded_in_place(client, server):
    ns = client.register_namespace(descriptor())
    keys = chain(ns.id, 3)
    rng = np.random.default_rng(1)
    # Two layers of 8 blocks, as an engine's per-layer KV tensors: [blocks, 2, 64] fp32.
    layers = [rng.standard_normal((8, 2, 64)).astype(np.float32) for _ in range(2)]
    regions = [Region(layer, block_bytes=layer[0].nbytes) for layer in layers]
    assert client.save_blocks(regions, keys, [5, 6, 7]) == ["stored"] * 3
    fresh = [np.zeros_like(layer) for layer in layers]
    out = client.load_blocks([Region(f, f[0].nbytes) for f in fresh], keys, [0, 1, 2])
    assert out == ["done"] * 3
    for f, layer in zip(fresh, layers):
        assert np.array_equal(f[:3], layer[5:8])
    with pytest.raises(orbitkv.InvalidArgument, match="block 8 lies outside region 0"):
        client.save_blocks(regions, keys[:1], [8])
    with pytest.raises(orbitkv.InvalidArgument, match="read-only"):
        client.load_blocks([Region(bytes(4096), 512)], keys[:1], [0])
    client.flush()
    assert server.shard_sum("leases") == 0


def test_large_block_batches_copy_on_several_threads(server):
    c = Client(server.socket, copy_threads=3)
    # Chunks of 128 KiB: 16 tokens x 2 layers x 2 x 1024 fp32.
    ns = c.register_namespace(descriptor(num_layers=2, head_dim=1024))
    keys = chain(ns.id, 96, seed=7)
    rng = np.random.default_rng(2)
    layers = [rng.integers(0, 255, (100, 64 << 10), dtype=np.uint8) for _ in range(2)]
    regions = [Region(layer, block_bytes=64 << 10) for layer in layers]
    assert c.save_blocks(regions, keys, list(range(96))) == ["stored"] * 96
    fresh = [np.zeros_like(layer) for layer in layers]
    target = list(range(99, 3, -1))
    assert c.load_blocks([Region(f, 64 << 10) for f in fresh], keys, target) == ["done"] * 96
    for f, layer in zip(fresh, layers):
        assert np.array_equal(f[target], layer[:96])
    with pytest.raises(orbitkv.InvalidArgument, match="block 5 named twice"):
        c.load_blocks([Region(f, 64 << 10) for f in fresh], keys[:2], [5, 5])
    c.flush()
    assert server.shard_sum("leases") == 0


def test_admin_requests_go_through_the_one_admin_client(server, tmp_path):
    """`orbitkv.admin`: the admin socket through the Rust `AdminClient` (as `orbitkv-ctl`)."""
    health = orbitkv.admin("health", socket=server.socket)
    assert health["ok"] is True and health["state"] == "serving", health
    refused = orbitkv.admin({"cmd": "nope"}, socket=server.socket)
    assert refused["ok"] is False and refused["error"] == 'unknown command "nope"', refused
    with pytest.raises(orbitkv.Unavailable, match="cannot connect"):
        orbitkv.admin("health", socket=tmp_path / "none.sock")
    with pytest.raises(orbitkv.InvalidArgument, match="JSON object"):
        orbitkv._native.admin_request("[1, 2]", os.fspath(server.socket))
    assert orbitkv.admin("stats", socket=server.socket)["ok"] is True


def test_kv_layout_is_the_wire_type():
    """`KvLayout` is the native module's (proto's `KvLayoutSpec`): no Python copy to drift."""
    layout = orbitkv.KvLayout("paged", 32, 4096, 16, 8, 128, 2)
    assert layout is not None and type(layout).__module__ == "orbitkv._native"
    assert (layout.kind, layout.num_layers, layout.num_blocks, layout.block_size) == ("paged", 32, 4096, 16)
    assert (layout.kv_heads, layout.head_dim, layout.elem_bytes) == (8, 128, 2)
    assert layout == orbitkv.KvLayout("paged", 32, 4096, 16, 8, 128, 2)
    assert layout != orbitkv.KvLayout("mla", 32, 4096, 16, 1, 576, 2)
    assert repr(layout).startswith("KvLayout(kind=\"paged\", num_layers=32")
    with pytest.raises(orbitkv.InvalidArgument, match="layout kind \"nope\": one of paged, flash_nhd"):
        orbitkv.KvLayout("nope", 32, 4096, 16, 8, 128, 2)
    with pytest.raises(OverflowError):
        orbitkv.KvLayout("paged", -1, 4096, 16, 8, 128, 2)


def test_golden_vectors_shared_with_rust():
    golden = json.loads((REPO / "proto" / "golden" / "hashing.json").read_text())
    assert orbitkv.PREFIX_SEED.hex() == golden["prefix_seed"]
    for case in golden["prefix"]:
        got = orbitkv.prefix_digests(case["tokens"], case["tokens_per_chunk"], bytes.fromhex(case["extra"]))
        assert [d.hex() for d in got] == case["digests"]
        # Chained: resuming from the first digest gives the rest.
        if len(got) > 1:
            rest = orbitkv.prefix_digests(case["tokens"][case["tokens_per_chunk"]:], case["tokens_per_chunk"],
                                          bytes.fromhex(case["extra"]), parent=got[0])
            assert rest == got[1:]
    for case in golden["engine"]:
        assert orbitkv.chunk_digest(bytes.fromhex(case["hash"])).hex() == case["digest"]
    # The namespace id pinned in the Rust tests.
    d = NamespaceDescriptor(model="meta-llama/Llama-3.1-8B", dtype="bf16", num_layers=32, num_kv_heads=8,
                            head_dim=128, tokens_per_chunk=256)
    assert d.id == 0x2881A422009E6AF4
    assert orbitkv.chunk_checksum(b"") == 0x2D06800538D394C2


def test_the_arena_mapping_names_its_memfds(client, server):
    """`arena()` gives the arena's length and each memfd's range in it (end to end): what
    `Client.cuda_arena` registers with CUDA, a file at a time. One per shard by default, whose
    bytes every client sees alike; one with `--arena-memfds one`. No addresses."""
    client.ping()
    info = client.arena()
    assert info is not None and info.connection == client.connection
    assert len(info.files) == server.admin("stats")["arena_memfds"], info
    assert server.admin("stats")["arena_bytes"] <= info.length
    one = Server(["--shards", "3", "--dram", "24MiB", "--arena-memfds", "one"])
    try:
        c = Client(one.socket, name="one-file")
        c.ping()
        info = c.arena()
        assert info is not None and info.files == [(0, info.length)], info
    finally:
        one.stop()
    per_shard = Server(["--shards", "3", "--dram", "24MiB"])
    try:
        writer, reader = Client(per_shard.socket, name="writer"), Client(per_shard.socket, name="reader")
        writer.ping()
        info = writer.arena()
        assert info is not None
        length, files = info.length, info.files
        assert len(files) == 3, files
        assert files[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(files, files[1:]))
        assert files[-1][0] + files[-1][1] == length
        ns = writer.register_namespace(descriptor())
        reader.register_namespace(descriptor())
        keys = [k for i in range(12) for k in chain(ns.id, 1, seed=i)]
        assert writer.put([(k, value(i)) for i, k in enumerate(keys)]) == ["stored"] * len(keys)
        for i, k in enumerate(keys):
            assert reader.get([k]) == [value(i)]
        assert per_shard.admin("stats")["arena_memfds"] == 3
    finally:
        per_shard.stop()


def test_host_arena_lends_the_arena_bytes(client, server):
    """A mapping of the arena of the process's own, lent as a buffer: leased chunks read there
    as they were put; it stays mapped while an array made from it lives."""
    ns = client.register_namespace(descriptor())
    keys = chain(ns.id, 3)
    assert client.put([(k, value(i)) for i, k in enumerate(keys)]) == ["stored"] * 3
    view = client.host_arena()
    info = client.arena()
    assert info is not None and view.connection == info.connection and view.device is None
    assert len(view) == info.length and not memoryview(view).readonly
    arena = np.frombuffer(view, dtype=np.uint8)
    del view
    leases = client.lookup_leased(keys)
    for i, lease in enumerate(leases):
        assert arena[lease.offset:lease.offset + lease.len].tobytes() == value(i)
    assert client.release(leases) == ["done"] * 3


def test_cuda_arena_without_cuda_is_a_clear_error(client, server):
    """Where libcuda or the device is missing, registering the arena names why; the session
    goes on serving. (On a CUDA host, tests/gpu registers it and copies through it.)"""
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
        pytest.skip("libcuda is installed here: tests/gpu covers the registration")
    except OSError:
        pass
    with pytest.raises(orbitkv.InvalidArgument, match="registering the arena with CUDA device 0: .*libcuda"):
        client.cuda_arena(0)
    ns = client.register_namespace(descriptor())
    assert client.put([(chain(ns.id, 1)[0], value(0))]) == ["stored"]


def test_restart_reconnects_and_registers_namespaces_again(client, server):
    ns = client.register_namespace(descriptor())
    keys = chain(ns.id, 2)
    client.put([(keys[0], value(0))])
    leases = client.lookup_leased(keys)
    first = (client.session_id, client.connection)
    server.kill()
    with pytest.raises((orbitkv.Disconnected, orbitkv.Unavailable)):
        client.ping()
    assert client.connection is None
    # Calls while it is down fail fast, without a connect attempt each.
    before = client.connect_attempts
    for _ in range(1000):
        with pytest.raises(orbitkv.Unavailable):
            client.lookup(keys)
    assert client.connect_attempts - before < 10
    server.start()
    wait_until("reconnect", lambda: _pings(client))
    assert client.put([(keys[1], value(1))]) == ["stored"]  # namespace registered again
    with pytest.raises(orbitkv.Stale):
        client.release(leases)
    assert server.admin("stats")["sessions"] == 1
    # The restarted Manager numbers sessions from 1 again; connections stay apart.
    assert client.session_id == first[0] and client.connection == first[1] + 1


def _pings(c: Client) -> bool:
    try:
        c.ping()
        return True
    except orbitkv.OrbitKVError:
        return False


def test_a_client_made_before_its_server_connects_once_it_is_up(tmp_path):
    from conftest import Server

    sock = tmp_path / "s.sock"
    c = Client(sock, connect=False, reconnect_backoff=0.01)
    assert not c.is_connected
    d = descriptor()
    with pytest.raises(orbitkv.Unavailable):
        c.register_namespace(d)
    with pytest.raises(orbitkv.Unavailable) as e:
        Client(sock)
    assert e.value.kind == "connect"
    s = Server(["--shards", "1", "--dram", "16MiB"], directory=str(tmp_path))
    try:
        wait_until("connect", lambda: _pings(c))
        k = ChunkKey(d.id, bytes(32))
        assert c.put([(k, value(0))]) == ["stored"]
    finally:
        s.stop()


def test_client_death_releases_its_leases(server):
    ns_args = "dict(model='test/model', dtype='fp32', num_layers=1, num_kv_heads=1, head_dim=512, tokens_per_chunk=16)"
    c = Client(server.socket)
    ns = c.register_namespace(descriptor())
    keys = chain(ns.id, 2)
    c.put([(k, value(i)) for i, k in enumerate(keys)])
    script = f"""
import orbitkv, sys, time
c = orbitkv.Client({server.socket!r})
ns = c.register_namespace(orbitkv.NamespaceDescriptor(**{ns_args}))
keys = [orbitkv.ChunkKey(ns.id, bytes.fromhex(h)) for h in sys.argv[1:]]
assert len(c.lookup_leased(keys)) == 2
print("held", flush=True)
time.sleep(60)
"""
    p = subprocess.Popen([sys.executable, "-c", script, *[k.digest.hex() for k in keys]], stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"held"
    assert server.shard_sum("leases") == 2
    p.kill()
    p.wait()
    wait_until("leases reclaimed", lambda: server.shard_sum("leases") == 0)
    assert len(c.lookup(keys)) == 2


def test_calls_release_the_gil():
    """A thread blocked in a call (a lookup on a server that does not answer) lets others run."""
    import socket as pysocket
    import tempfile

    d = tempfile.mkdtemp(prefix="okvgil", dir="/tmp")
    path = os.path.join(d, "mute.sock")
    listener = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)  # accepts, never answers the hello: connect waits for the timeout
    ticks = []
    done = threading.Event()

    def connect():
        try:
            Client(path, request_timeout=1.0)
        except orbitkv.OrbitKVError:
            pass
        done.set()

    t = threading.Thread(target=connect)
    t.start()
    while not done.is_set():
        ticks.append(time.monotonic())
        time.sleep(0.001)
    t.join()
    listener.close()
    assert len(ticks) > 100, f"the main thread ran {len(ticks)} times during a 1 s blocked connect"
