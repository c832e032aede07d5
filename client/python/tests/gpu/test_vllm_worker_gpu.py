"""The vLLM connector's worker side with a GPU KV cache (vLLM >= 0.32 views, per layer LBNHC),
against a real Manager with a GPU, by both copy paths: saves queued after the forward pass's
work, loads into other blocks, a load error reported per block, and a cache whose page order is
not vLLM's layout refused; a hybrid model's KV cache groups (vLLM's hybrid KV cache manager:
the groups' layers share allocations, block ids are per group) saved and loaded group by group.

vLLM runs on the CPU in CI, where this skips; the GPU machine has no vLLM. There the few vLLM
names the connector's modules import (its logger, the connector base classes, the stats base
class) are stood in for by minimal modules, so that the worker's own code runs on the GPU; the
connector against the real vLLM is tested in tests/vllm. Skipped without torch or CUDA.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import sys
import time
import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)


def _stand_in_for_vllm() -> None:
    def module(name: str, **attrs) -> None:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m

    class Role(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class Base:
        def __init__(self, *a, **k) -> None:
            pass

    @dataclasses.dataclass
    class Stats:
        data: dict = dataclasses.field(default_factory=dict)

    for name in ("vllm", "vllm.distributed", "vllm.distributed.kv_transfer",
                 "vllm.distributed.kv_transfer.kv_connector", "vllm.distributed.kv_transfer.kv_connector.v1"):
        module(name)
    module("vllm.logger", init_logger=logging.getLogger)
    @dataclasses.dataclass
    class TransferResults:
        finished_sending: set = dataclasses.field(default_factory=set)
        finished_recving: set = dataclasses.field(default_factory=set)
        failed_recving: set = dataclasses.field(default_factory=set)

    module("vllm.distributed.kv_transfer.kv_connector.v1.base", KVConnectorBase_V1=Base, KVConnectorMetadata=Base,
           KVConnectorRole=Role, SupportsHMA=type("SupportsHMA", (), {}), KVConnectorTransferResults=TransferResults)
    class Factory:
        @classmethod
        def register_connector(cls, *a) -> None:
            pass

    module("vllm.distributed.kv_transfer.kv_connector.v1.metrics", KVConnectorStats=Stats, KVConnectorPromMetrics=Base)
    module("vllm.distributed.kv_transfer.kv_connector.factory", KVConnectorFactory=Factory)


try:
    from vllm.logger import init_logger  # noqa: F401
except ImportError:  # (a bare `import vllm` could find the tests' own vllm/ folder)
    _stand_in_for_vllm()

import kv_views  # noqa: E402
import orbitkv  # noqa: E402
from orbitkv.vllm.config import ConfigError  # noqa: E402
from orbitkv.vllm.worker import WorkerSide  # noqa: E402

L, B, BS, HEADS, DIM = 4, 32, 16, 8, 128


def vllm_config(layout: str = "LBNHC"):
    mc = types.SimpleNamespace(
        model="tiny-gpu", served_model_name="tiny-gpu", dtype=torch.bfloat16, use_mla=False,
        get_num_layers=lambda pc: L, get_num_kv_heads=lambda pc: HEADS, get_head_size=lambda: DIM,
    )
    return types.SimpleNamespace(
        model_config=mc,
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
        cache_config=types.SimpleNamespace(block_size=BS, cache_dtype="auto", kv_cache_layout=layout,
                                           prefix_caching_hash_algo="sha256"),
        device_config=types.SimpleNamespace(device_type="cuda"),
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config={}),
    )


def caches(layout: str, fill: bool):
    views = kv_views.views(torch, layout, L, B, HEADS, BS, 2 * DIM, torch.bfloat16, device="cuda", fill=fill)
    return {f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(views)}


def worker(server, path: str, layout: str, fill: bool, **extra):
    w = WorkerSide(vllm_config(), {"socket": server.socket, "gpu_path": path, **extra})
    kv = caches(layout, fill)
    w.register_kv_caches(kv)
    return w, list(kv.values())


def finished_loading(w, rid: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        _, recving = w.get_finished(set())
        if recving and rid in recving:
            return
        assert time.monotonic() < deadline, f"load of {rid} not finished"
        time.sleep(0.01)


@pytest.mark.parametrize("save_path,load_path", [("server", "engine"), ("engine", "server"), ("auto", "auto")])
def test_worker_saves_and_loads_gpu_blocks(gpu_server, save_path, load_path):
    digests = [orbitkv.chunk_digest(f"{save_path}-{i}".encode() * 4) for i in range(6)]
    saver, src = worker(gpu_server, save_path, "LBNHC", True)
    # Under `auto` saves go by the engine's copies (no time-slicing with the Manager's context).
    assert saver.gpu[0].active_save_path == ("engine" if save_path == "auto" else save_path)
    # The forward pass wrote the blocks on the current stream: the save waits for that work.
    for v in src:
        v[3:9].mul_(-1)
    saver.start_saves({"r1": [(0, digests, [3, 4, 5, 6, 7, 8])]})
    saver.wait_for(["r1"])
    assert saver.get_finished({"r1"})[0] == {"r1"}
    assert saver.stats.totals()["saved_blocks"] == 6

    loader, dst = worker(gpu_server, load_path, "LBNHC", False)
    assert loader.gpu[0].active_path == (load_path if load_path != "auto" else "server")
    missing = orbitkv.chunk_digest(b"never saved" * 4)
    loader.start_loads({"r2": [(0, digests[:4] + [missing], [20, 21, 22, 23, 24])]})
    finished_loading(loader, "r2")
    assert loader.take_load_errors() == {24}
    torch.cuda.synchronize()
    for a, b in zip(dst, src):
        assert torch.equal(a[20:24], b[3:7])
    assert loader.stats.totals()["loaded_blocks"] == 4
    saver.shutdown()
    loader.shutdown()
    assert gpu_server.shard_sum("leases") == 0


def test_a_cache_unlike_vllms_layout_is_refused(gpu_server):
    w = WorkerSide(vllm_config("LBNHC"), {"socket": gpu_server.socket})
    with pytest.raises(ConfigError, match="HNC"):
        w.register_kv_caches(caches("LBHNC", False))
    w = WorkerSide(vllm_config("LHBNC"), {"socket": gpu_server.socket})
    with pytest.raises(ConfigError, match="LHBNC"):
        w.register_kv_caches(caches("LHBNC", False))


def test_saves_and_loads_may_take_different_paths(gpu_server):
    """`gpu_save_path` apart from `gpu_path`: saves by the Manager, loads by the engine, in one
    worker; and a path that is not one of the three is refused naming it."""
    digests = [orbitkv.chunk_digest(f"split-{i}".encode() * 4) for i in range(3)]
    w, kv = worker(gpu_server, "engine", "LBNHC", True, gpu_save_path="server")
    assert (w.gpu[0].active_save_path, w.gpu[0].active_path) == ("server", "engine")
    w.start_saves({"r1": [(0, digests, [1, 2, 3])]})
    w.wait_for(["r1"])
    w.start_loads({"r2": [(0, digests, [10, 11, 12])]})
    finished_loading(w, "r2")
    torch.cuda.synchronize()
    for v in kv:
        assert torch.equal(v[10:13], v[1:4])
    w.shutdown()
    with pytest.raises(ConfigError, match="GPU save path 'dma'"):
        worker(gpu_server, "auto", "LBNHC", False, gpu_save_path="dma")


class SlidingWindowSpec:  # vLLM's spec classes by name, as config.groups reads them
    def __init__(self, window: int) -> None:
        self.block_size, self.num_kv_heads, self.head_size = BS, HEADS, DIM
        self.sliding_window, self.extra_retained_tokens = window, 0


class FullAttentionSpec:
    def __init__(self) -> None:
        self.block_size, self.num_kv_heads, self.head_size = BS, HEADS, DIM


def hybrid_caches(fill: bool):
    """vLLM's hybrid layout on CUDA: layer i of each group shares one allocation (group 0: the
    sliding-window layers 0 and 1, group 1: the full-attention layers 2 and 3)."""
    views = kv_views.views(torch, "LBNHC", 2, B, HEADS, BS, 2 * DIM, torch.bfloat16, device="cuda", fill=fill)
    kv = {}
    for i, v in enumerate(views):
        kv[f"model.layers.{i}.self_attn.attn"] = v
        kv[f"model.layers.{i + 2}.self_attn.attn"] = v.view(v.shape)  # the same memory
    cfg = types.SimpleNamespace(kv_cache_groups=[
        types.SimpleNamespace(layer_names=["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                              kv_cache_spec=SlidingWindowSpec(2 * BS)),
        types.SimpleNamespace(layer_names=["model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"],
                              kv_cache_spec=FullAttentionSpec()),
    ])
    return kv, cfg


@pytest.mark.parametrize("path", ["server", "engine"])
def test_a_hybrid_models_groups_are_saved_and_loaded_group_by_group(gpu_server, path):
    from orbitkv.vllm.config import groups

    digests = [orbitkv.chunk_digest(f"hybrid-{path}-{i}".encode() * 4) for i in range(3)]
    kv, cfg = hybrid_caches(True)
    gs = groups(vllm_config(), cfg)
    assert [g.kind for g in gs] == ["sliding_window", "full"]
    saver = WorkerSide(vllm_config(), {"socket": gpu_server.socket, "gpu_path": path, "gpu_save_path": path}, gs)
    saver.register_kv_caches(kv)
    assert not saver.sync_loads, "several groups: loads are async"
    # The same block hashes, each group in its own blocks of the shared allocations.
    saver.start_saves({"r1": [(0, digests[1:], [4, 5]), (1, digests, [7, 8, 9])]})
    saver.wait_for(["r1"])
    assert saver.stats.totals()["saved_blocks"] == 5

    dst, _ = hybrid_caches(False)
    loader = WorkerSide(vllm_config(), {"socket": gpu_server.socket, "gpu_path": path}, gs)
    loader.register_kv_caches(dst)
    missing = orbitkv.chunk_digest(b"not saved" * 4)
    loader.start_loads({"r2": [(0, digests[1:], [20, 21]), (1, digests, [22, 23, 24])]})
    finished_loading(loader, "r2")
    loader.start_loads({"r3": [(0, [missing], [25]), (1, digests[:1], [26])]})
    finished_loading(loader, "r3")
    # A failed load of a several-group model is reported for its request, no block errors.
    assert loader.take_failed_loads() == {"r3"} and loader.take_load_errors() == set()
    torch.cuda.synchronize()
    src_views = list(kv.values())
    dst_views = list(dst.values())
    for layer in range(4):
        a, b = src_views[layer], dst_views[layer]
        assert torch.equal(b[20:22], a[4:6]), "group 0's blocks, every layer"
        assert torch.equal(b[22:25], a[7:10]), "group 1's blocks, every layer"
    saver.shutdown()
    loader.shutdown()
    assert gpu_server.shard_sum("leases") == 0
