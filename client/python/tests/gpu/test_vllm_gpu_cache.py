"""A vLLM (>= 0.32) GPU KV cache copied through `orbitkv.gpu.GpuBlockCopies`, against a real
Manager with a GPU: the caches are built as vLLM builds them (`kv_views`, checked against
vLLM's own views in the vLLM tests), per layer (LBNHC, LBHNC, MLA) and cross-layer (BLNHC).
Both copy paths (the server's DMA threads, the engine's own copies) read each other's chunks;
a per-layer and a cross-layer cache of one order read each other's chunks; a Manager restart
renews the registration; a Manager without GPU mode makes `auto` copy in the engine.

Skipped without torch or a CUDA device.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import kv_views  # noqa: E402
import orbitkv  # noqa: E402
from conftest import Server  # noqa: E402
from orbitkv import Client, NamespaceDescriptor  # noqa: E402
from orbitkv.gpu import GpuBlockCopies, GpuKvCache  # noqa: E402

L, B, BS, HEADS, DIM, LATENT = 4, 48, 16, 8, 128, 576


def cache(layout: str, mla: bool, fill: bool):
    heads, content = (1, LATENT) if mla else (HEADS, 2 * DIM)
    return kv_views.views(torch, layout, L, B, heads, BS, content, torch.bfloat16, device="cuda", fill=fill)


def keys(client, model: str, n: int, seed: int):
    d = NamespaceDescriptor(model=model, dtype="bf16", num_layers=L, num_kv_heads=HEADS, head_dim=DIM,
                            tokens_per_chunk=BS)
    ns = client.register_namespace(d)
    return ns.keys(orbitkv.prefix_digests([(t * 7919 + seed) % 50000 for t in range(n * BS)], BS))


def same_blocks(a, a_blocks, b, b_blocks) -> bool:
    torch.cuda.synchronize()
    ia = torch.tensor(a_blocks, device="cuda")
    ib = torch.tensor(b_blocks, device="cuda")
    return all(torch.equal(x.index_select(0, ia), y.index_select(0, ib)) for x, y in zip(a, b))


@pytest.mark.parametrize("layout,mla", [("LBNHC", False), ("LBHNC", False), ("BLNHC", False), ("LBHNC", True)])
def test_server_and_engine_paths_read_each_others_chunks(gpu_server, layout, mla):
    c = Client(gpu_server.socket, request_timeout=60)
    src, dst = cache(layout, mla, True), cache(layout, mla, False)
    server = GpuBlockCopies(c, GpuKvCache(src, mla=mla), "server")
    engine = GpuBlockCopies(c, GpuKvCache(dst, mla=mla), "engine")
    expect_kind = "cross_layer" if layout[0] == "B" else ("mla" if mla else "paged")
    assert server.cache.kind == expect_kind
    k = keys(c, f"vllm-gpu-{layout}-{mla}", 16, 1)
    torch.cuda.synchronize()
    assert server.save(k[:8], list(range(8))) == ["stored"] * 8
    assert server.active_path == "server"
    assert engine.load(k[:8], list(range(30, 38))) == ["done"] * 8
    assert same_blocks(dst, list(range(30, 38)), src, list(range(8)))
    # The other way round (the engine saves, the server loads), and a load that stops at the
    # first missing chunk.
    engine_src = GpuBlockCopies(c, GpuKvCache(src, mla=mla), "engine")
    assert engine_src.save(k[8:], list(range(8, 16))) == ["stored"] * 8
    assert engine_src.save(k[8:9], [8]) == ["already_present"]
    dst2 = cache(layout, mla, False)
    back = GpuBlockCopies(c, GpuKvCache(dst2, mla=mla), "server")
    assert back.load(k[8:] + keys(c, "missing", 2, 9), list(range(10))) == ["done"] * 8 + ["not_found"] * 2
    assert same_blocks(dst2, list(range(8)), src, list(range(8, 16)))
    for x in (server, engine, engine_src, back):
        x.close()
    c.flush()
    assert gpu_server.shard_sum("leases") == 0


def test_per_layer_and_cross_layer_caches_share_chunks(gpu_server):
    c = Client(gpu_server.socket, request_timeout=60)
    lb, bl = cache("LBNHC", False, True), cache("BLNHC", False, False)
    k = keys(c, "vllm-gpu-lb-bl", 6, 2)
    a = GpuBlockCopies(c, GpuKvCache(lb), "server")
    b = GpuBlockCopies(c, GpuKvCache(bl), "server")
    torch.cuda.synchronize()
    assert a.save(k, [5, 4, 3, 2, 1, 0]) == ["stored"] * 6
    assert b.load(k, [10, 11, 12, 13, 14, 15]) == ["done"] * 6
    assert same_blocks(bl, [10, 11, 12, 13, 14, 15], lb, [5, 4, 3, 2, 1, 0])
    a.close()
    b.close()


def test_a_manager_restart_renews_the_registration():
    s = Server(["--shards", "2", "--dram", "256MiB", "--gpu", "required"])
    try:
        c = Client(s.socket, request_timeout=60)
        src = cache("LBNHC", False, True)
        copies = GpuBlockCopies(c, GpuKvCache(src), "server")
        torch.cuda.synchronize()
        assert copies.save(keys(c, "restart", 2, 3), [0, 1]) == ["stored"] * 2
        s.restart()
        k = keys(c, "restart", 4, 4)
        deadline = time.monotonic() + 20
        while True:
            try:
                assert copies.save(k, [0, 1, 2, 3]) == ["stored"] * 4
                break
            except (orbitkv.Unavailable, orbitkv.Disconnected):
                assert time.monotonic() < deadline, "no reconnect in 20 s"
                time.sleep(0.05)
        assert copies.active_path == "server"
        dst = cache("LBNHC", False, False)
        assert GpuBlockCopies(c, GpuKvCache(dst), "engine").load(k, [7, 8, 9, 10]) == ["done"] * 4
        assert same_blocks(dst, [7, 8, 9, 10], src, [0, 1, 2, 3])
        copies.close()
    finally:
        s.stop()


def test_auto_copies_in_the_engine_when_the_manager_has_no_gpu():
    s = Server(["--shards", "2", "--dram", "256MiB", "--gpu", "off"])
    try:
        c = Client(s.socket, request_timeout=60)
        src, dst = cache("LBHNC", False, True), cache("LBHNC", False, False)
        a = GpuBlockCopies(c, GpuKvCache(src), "auto")
        with pytest.raises(orbitkv.OrbitKVError):
            GpuBlockCopies(c, GpuKvCache(src), "server").prepare()
        k = keys(c, "no-gpu", 5, 5)
        torch.cuda.synchronize()
        assert a.save(k, [1, 2, 3, 4, 5]) == ["stored"] * 5
        assert a.active_path == "engine"
        assert GpuBlockCopies(c, GpuKvCache(dst), "auto").load(k, [0, 1, 2, 3, 4]) == ["done"] * 5
        assert same_blocks(dst, [0, 1, 2, 3, 4], src, [1, 2, 3, 4, 5])
        with pytest.raises(orbitkv.InvalidArgument, match="copy path"):
            GpuBlockCopies(c, GpuKvCache(src), "dma")
    finally:
        s.stop()
