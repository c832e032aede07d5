"""The fake Manager (`fake_native`) through `orbitkv.Client`, held to the native client's
documented semantics that the connector tests rely on: longest present prefixes, leases released
once, blocks gathered and scattered region by region, the outcome names, buffers as objects
(regions `(buffer, block_bytes, block_stride)`), refusals naming the argument, and sessions
that end and reconnect. Needs neither vLLM nor torch."""

from __future__ import annotations

import fake_native
import numpy as np
import orbitkv
import pytest
from orbitkv import ChunkKey, Client, NamespaceDescriptor, Region


@pytest.fixture
def manager(monkeypatch):
    return fake_native.install(monkeypatch)


def namespace(client: Client) -> orbitkv.Namespace:
    return client.register_namespace(NamespaceDescriptor("fake", "fp16", 2, 1, 16, 32))


def chain(ns: orbitkv.Namespace, n: int, seed: int = 0):
    return [ns.key(bytes([seed, i]) * 16) for i in range(n)]


def test_lookups_find_the_longest_present_prefix_and_leases_go_back_once(manager):
    c = Client(name="t")
    ns = namespace(c)
    ks = chain(ns, 4)
    assert c.put([(ks[0], b"a" * 10), (ks[1], bytearray(b"b" * 20)), (ks[3], np.ones(4, np.float32))]) == [
        "stored"] * 3
    assert c.put([(ks[0], b"x")]) == ["already_present"]
    assert [h.len for h in c.lookup(ks)] == [10, 20], "stops at the first missing key"
    leases = c.lookup_leased(ks)
    assert [lease.key for lease in leases] == ks[:2] and manager.leases_held() == 2
    assert bytes(c.read(leases[1])) == b"b" * 20
    assert c.release(leases) == ["done", "done"]
    assert c.release(leases[:1]) == ["not_found"] and manager.bad_releases, "a second release is recorded"
    manager.bad_releases.clear()
    out = [bytearray(10), np.zeros(20, np.uint8)]
    assert c.get_into(ks[:2], out) == [10, 20] and bytes(out[1]) == b"b" * 20
    manager.assert_quiet()


def test_blocks_are_gathered_region_by_region_and_scattered_back(manager):
    c = Client(name="t")
    ns = namespace(c)
    ks = chain(ns, 3, seed=1)
    dense = np.arange(8 * 16, dtype=np.uint8)  # 8 blocks of 16 bytes
    strided = np.arange(8 * 32, dtype=np.uint8) + 100  # 8 blocks of 8 bytes every 32
    regions = [Region(dense, 16), Region(strided, 8, 32)]
    assert c.save_blocks(regions, ks[:2], [1, 2, 5, 6]) == ["stored", "stored"]
    assert manager.chunks[ks[0]] == bytes(dense[16:48]) + bytes(strided[32:40]) + bytes(strided[64:72])
    (call,) = manager.recorded("save_blocks")
    assert call.blocks == (1, 2, 5, 6) and call.outcomes == ("stored", "stored")
    d2, s2 = np.zeros_like(dense), np.zeros_like(strided)
    out = c.load_blocks([Region(d2, 16), Region(s2, 8, 32)], ks, [0, 3, 4, 7, 1, 2])
    assert out == ["done", "done", "not_found"], "the longest present prefix"
    assert bytes(d2[0:16]) == bytes(dense[16:32]) and bytes(s2[96:104]) == bytes(strided[64:72])
    manager.fail_load(ks[1])
    assert c.load_blocks([Region(d2, 16), Region(s2, 8, 32)], ks, [0, 3, 4, 7, 1, 2]) == [
        "done", "invalid_argument", "not_found"]
    manager.assert_quiet()


def test_bad_buffers_and_blocks_are_refused_naming_them(manager):
    c = Client(name="t")
    ns = namespace(c)
    ks = chain(ns, 1, seed=2)
    with pytest.raises(orbitkv.InvalidArgument, match="region 0 is read-only"):
        c.load_blocks([Region(bytes(64), 16)], ks, [0])
    with pytest.raises(orbitkv.InvalidArgument, match="region 1 of type int has no buffer protocol"):
        c.save_blocks([Region(bytes(64), 16), Region(7, 16)], ks, [0])
    with pytest.raises(orbitkv.InvalidArgument, match="block 4 lies outside region 0"):
        c.save_blocks([Region(bytes(64), 16)], ks, [4])
    with pytest.raises(orbitkv.InvalidArgument, match="3 block ids for 2 keys"):
        c.save_blocks([Region(bytes(64), 16)], chain(ns, 2, seed=2), [0, 1, 2])
    buf = bytearray(64)
    with pytest.raises(orbitkv.InvalidArgument, match="region 0 and region 1 overlap"):
        c.load_blocks([Region(buf, 16), Region(memoryview(buf)[16:], 16)], ks, [0])
    # The native boundary's old form, an address and a length, is no buffer.
    native = manager.client("t")
    with pytest.raises(TypeError, match="region 0 is not a \\(buffer, block_bytes, block_stride\\)"):
        native.save_blocks([(0x1000, 64, 16, 16)], ks, [0])
    with pytest.raises(orbitkv.ServerError, match="not registered by this session") as e:
        c.lookup([ChunkKey(ns.id ^ 1, bytes(32))])
    assert (e.value.kind, e.value.code) == ("unknown_namespace", "unknown_namespace")


def test_a_stopped_manager_ends_the_session_and_a_restarted_one_serves_its_namespaces(manager):
    c = Client(name="t", connect=False)
    assert not c.is_connected
    ns = namespace(c)
    ks = chain(ns, 2, seed=3)
    c.put([(k, b"v") for k in ks])
    held = c.lookup_leased(ks)
    manager.stop()
    with pytest.raises(orbitkv.Disconnected) as e:
        c.lookup(ks)
    assert e.value.kind == "disconnected" and manager.dropped_leases == 2
    with pytest.raises(orbitkv.Unavailable):
        c.lookup(ks)
    manager.start()
    assert len(c.lookup(ks)) == 2, "the namespace is registered again by the new session"
    with pytest.raises(orbitkv.Stale):
        c.release_deferred(held)
    assert c.connect_attempts == 3 and manager.bad_releases == []
    manager.assert_quiet()
