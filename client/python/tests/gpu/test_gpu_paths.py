"""The package's two GPU paths on a CUDA machine, against a real Manager with a GPU: engine
tensors shared by CUDA IPC and copied by the server's DMA threads (`Client.register_gpu`,
`save`, `load`, `start_save`), and the engine's own copies through its registered mapping of the
arena (`orbitkv.gpu.EngineCopies`). Each path reads the other's chunks, byte for byte.

Skipped, saying why, without torch or a CUDA device. The Manager must be built with CUDA
support (`ORBITKV_SERVER_BIN`, a release build with cudarc's dynamic loading).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import orbitkv  # noqa: E402
from orbitkv import Client, KvLayout, NamespaceDescriptor  # noqa: E402
from orbitkv.gpu import EngineCopies, device_uuid  # noqa: E402

LAYERS, BLOCKS, BS, HEADS, DIM = 4, 64, 16, 8, 128


def kv_cache(seed: int):
    """vLLM FlashAttention NHD: per layer [2, blocks, block_size, heads, head_dim], bf16."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(2, BLOCKS, BS, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(LAYERS)]


def pieces(cache, block):
    """A block's chunk in the server's order: layer by layer, K before V."""
    return [cache[layer][kv, block] for layer in range(LAYERS) for kv in range(2)]


def namespace(client, model):
    d = NamespaceDescriptor(model=model, dtype="bf16", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                            tokens_per_chunk=BS)
    return client.register_namespace(d)


def keys(ns, n, seed):
    return ns.keys(orbitkv.prefix_digests([(t * 7919 + seed) % 50000 for t in range(n * BS)], BS))


def test_server_dma_and_engine_copies_read_each_others_chunks(gpu_server):
    c = Client(gpu_server.socket, request_timeout=60)
    ns = namespace(c, "gpu-test")
    src, dst = kv_cache(1), kv_cache(2)
    layout = KvLayout("flash_nhd", LAYERS, BLOCKS, BS, HEADS, DIM, 2)
    torch.cuda.synchronize()

    reg = c.register_gpu(device_uuid(), layout, src)
    k1 = keys(ns, 8, 1)
    assert c.save(reg, k1, list(range(8))) == ["done"] * 8
    # Loaded by the DMA threads into other blocks of another cache.
    reg2 = c.register_gpu(device_uuid(), layout, dst)
    assert c.load(reg2, k1, list(range(20, 28))) == ["done"] * 8
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(dst[layer][:, 20:28], src[layer][:, 0:8])
    # A started save, waited for; and a load of a missing key's prefix.
    k2 = keys(ns, 4, 2)
    t = c.start_save(reg, k2, [8, 9, 10, 11])
    assert c.wait_transfer(t) == ["done"] * 4
    assert c.load(reg2, keys(ns, 2, 3), [0, 1]) == ["not_found", "not_found"]

    # The engine's own copies read what the DMA threads saved ...
    e = EngineCopies(c)
    out = [torch.zeros_like(p) for p in pieces(src, 0)]
    assert e.load(k2[:1], [out]) == ["done"]
    assert all(torch.equal(a, b) for a, b in zip(out, pieces(src, 8)))
    # ... and save chunks the DMA threads load.
    k3 = keys(ns, 4, 4)
    assert e.save(k3, [pieces(src, b) for b in range(40, 44)]) == ["stored"] * 4
    assert e.save(k3[:1], [pieces(src, 40)]) == ["already_present"]
    assert c.load(reg2, k3, [60, 61, 62, 63]) == ["done"] * 4
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(dst[layer][:, 60:64], src[layer][:, 40:44])
    # A chunk split otherwise than saved is refused, nothing copied.
    half = [torch.zeros(10, device="cuda", dtype=torch.bfloat16)]
    assert e.load(k3[:1], [half]) == ["invalid_argument"]

    c.unregister_gpu(reg)
    c.unregister_gpu(reg2)
    e.close()
    c.flush()
    stats = gpu_server.admin("stats")
    assert sum(s["leases"] for s in stats["shards"]) == 0


def test_bad_registrations_are_refused_naming_the_field(gpu_server):
    c = Client(gpu_server.socket, request_timeout=60)
    cache = kv_cache(3)
    layout = KvLayout("flash_nhd", LAYERS, BLOCKS, BS, HEADS, DIM, 2)
    with pytest.raises(orbitkv.OrbitKVError, match="tensor"):
        c.register_gpu(device_uuid(), layout, cache[:-1])
    with pytest.raises(orbitkv.InvalidArgument, match="layout kind"):
        c.register_gpu(device_uuid(), KvLayout("nope", LAYERS, BLOCKS, BS, HEADS, DIM, 2), cache)
    with pytest.raises(orbitkv.OrbitKVError):
        c.register_gpu("GPU-00000000-0000-0000-0000-000000000000", layout, cache)
    c.ping()
