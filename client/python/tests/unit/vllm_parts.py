"""vLLM's side of the unit tests' call sequences: its configuration (a tiny model: 2 layers, one
KV head of 16, 32-token blocks, a CPU KV cache), its own `Request`s with sha256 block hashes,
scheduler outputs, allocations and connector outputs, and the connector built on a fake Manager
(`fake_native`). Imported only where vLLM and torch are installed."""

from __future__ import annotations

import collections
import logging
import threading
import time
import types
from typing import Any, Dict, Iterable, List, Optional, Sequence

import pytest
import torch
from fake_native import FakeManager
from orbitkv import ChunkKey, chunk_digest
from orbitkv.vllm import OrbitKVConnector, OrbitKVConnectorMetadata
from orbitkv.vllm.config import namespace
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

BS = 32
#: A chunk of the tiny model: one block of both layers, 32 tokens of K and V (16 each), float32.
CHUNK = 2 * BS * 32 * 4
#: The KV cache layout vLLM's CPU attention resolves (and the one the namespaces are made for).
LAYOUT = "LBHNC"

init_none_hash(sha256)


def vllm_config(tp: int = 1, extra: Optional[Dict[str, Any]] = None) -> Any:
    mc = types.SimpleNamespace(
        model="tiny", served_model_name="tiny", dtype=torch.float32, use_mla=False,
        get_num_layers=lambda pc: 2, get_num_kv_heads=lambda pc: 1, get_head_size=lambda: 16,
    )
    return types.SimpleNamespace(
        model_config=mc,
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp),
        cache_config=types.SimpleNamespace(block_size=BS, cache_dtype="auto", kv_cache_layout=LAYOUT,
                                           prefix_caching_hash_algo="sha256"),
        device_config=types.SimpleNamespace(device_type="cpu"),
        kv_transfer_config=types.SimpleNamespace(
            kv_connector="OrbitKVConnector", kv_connector_module_path="orbitkv.vllm", kv_role="kv_both",
            kv_connector_extra_config=dict(extra or {}),
        ),
    )


def prompt(n_blocks: int, seed: int = 0, tail: int = 5) -> List[int]:
    """`n_blocks` full blocks of tokens and `tail` more; prompts of one seed share their blocks."""
    return [seed * 100_000 + i for i in range(n_blocks * BS + tail)]


def request(rid: str, tokens: List[int]) -> Request:
    """vLLM's own request, its block hashes chained with sha256 as its scheduler makes them."""
    return Request(rid, tokens, SamplingParams(max_tokens=8), None,
                   block_hasher=get_request_block_hasher(BS, sha256))


def digests(req: Request, n: Optional[int] = None) -> List[bytes]:
    """OrbitKV's chunk digests of the request's first `n` blocks (all by default)."""
    return [chunk_digest(bytes(h)) for h in req.block_hashes[:n]]


def keys(cfg: Any, req: Request, n: Optional[int] = None, rank: int = 0) -> List[ChunkKey]:
    """The keys rank `rank` saves the request's first `n` blocks under."""
    ns = namespace(cfg, rank, LAYOUT).id
    return [ChunkKey(ns, d) for d in digests(req, n)]


def store(manager: FakeManager, cfg: Any, req: Request, n: int, rank: int = 0, size: int = CHUNK) -> List[ChunkKey]:
    """Puts the first `n` blocks of `req` into the Manager as rank `rank` would have saved them."""
    ks = keys(cfg, req, n, rank)
    for i, k in enumerate(ks):
        manager.store(k, bytes([i % 256]) * size)
    return ks


def blocks(ids: Sequence[int]) -> KVCacheBlocks:
    """vLLM's allocation of block ids `ids` (one KV cache group)."""
    return KVCacheBlocks(([KVCacheBlock(block_id=b) for b in ids],))


def step(scheduled: Optional[Dict[str, int]] = None, preempted: Iterable[str] = (),
         finished: Iterable[str] = ()) -> SchedulerOutput:
    """vLLM's scheduler output of one step: tokens scheduled per request, requests preempted
    and finished."""
    scheduled = dict(scheduled or {})
    return SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(finished),
        free_encoder_mm_hashes=[], preempted_req_ids=set(preempted),
    )


def output(recving: Iterable[str] = (), sending: Iterable[str] = (), failed: Iterable[str] = ()) -> KVConnectorOutput:
    """The workers' connector output as vLLM hands it to the scheduler side."""
    return KVConnectorOutput(finished_sending=set(sending) or None, finished_recving=set(recving) or None,
                             failed_recving=set(failed))


def metadata(loads: Any = None, saves: Any = None, preempted: Sequence[str] = ()) -> OrbitKVConnectorMetadata:
    return OrbitKVConnectorMetadata(loads=dict(loads or {}), saves=dict(saves or {}), preempted=list(preempted))


class Connectors:
    """Builds connectors on the fake Manager and shuts down those a test leaves running."""

    def __init__(self, manager: FakeManager) -> None:
        self.manager = manager
        self.running: List[OrbitKVConnector] = []

    def scheduler(self, tp: int = 1, **extra: Any) -> OrbitKVConnector:
        """A scheduler-side connector; async loads and a generous lookup wait unless `extra`
        says otherwise (these tests check what a lookup answers, not when)."""
        extra = {"lookup_wait": 30.0, "load_mode": "async", **extra}
        return self._made(OrbitKVConnector(vllm_config(tp, extra), KVConnectorRole.SCHEDULER, None))

    def worker(self, tp: int = 1, layers: int = 2, num_blocks: int = 8, seed: int = 0,
               **extra: Any) -> "tuple[OrbitKVConnector, Dict[str, torch.Tensor]]":
        """A worker-side connector with a CPU KV cache of random blocks (LBHNC per layer: blocks,
        one head, 32 tokens, K and V of 16 each), registered."""
        conn = self._made(OrbitKVConnector(vllm_config(tp, extra), KVConnectorRole.WORKER, None))
        g = torch.Generator().manual_seed(seed)
        kv = {f"model.layers.{i}.attn": torch.randn(num_blocks, 1, BS, 32, generator=g) for i in range(layers)}
        conn.register_kv_caches(kv)
        return conn, kv

    def _made(self, conn: OrbitKVConnector) -> OrbitKVConnector:
        self.running.append(conn)
        return conn

    def shutdown(self, conn: OrbitKVConnector) -> None:
        self.running.remove(conn)
        conn.shutdown()

    def shutdown_all(self) -> None:
        while self.running:
            self.shutdown(self.running[-1])


class Steps:
    """vLLM's model runner around one connector (0.32's `_get_kv_connector_output`): per step,
    the preemptions, the metadata bound, loads started, saves handed over after the forward
    pass, then what finished, the blocks that failed to load and the stats; `stats` sums them."""

    def __init__(self, conn: OrbitKVConnector) -> None:
        self.conn = conn
        self._stats = collections.Counter()

    @property
    def stats(self) -> "collections.Counter[str]":
        """The counters reported so far, and those of the step under way."""
        taken = self.conn.get_kv_connector_stats()
        if taken is not None:
            self._stats.update(taken.data)
        return self._stats

    def run(self, meta: Any = None, finished: Iterable[str] = ()) -> KVConnectorOutput:
        conn, meta = self.conn, meta if meta is not None else metadata()
        conn.handle_preemptions(meta)
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)
        conn.wait_for_save()
        res = conn.get_transfer_results(set(finished))
        out = KVConnectorOutput(
            finished_sending=res.finished_sending or None, finished_recving=res.finished_recving or None,
            failed_recving=res.failed_recving, invalid_block_ids=conn.get_block_ids_with_load_errors(),
            kv_connector_stats=conn.get_kv_connector_stats(),
        )
        conn.clear_connector_metadata()
        if out.kv_connector_stats is not None:
            self._stats.update(out.kv_connector_stats.data)
        return out

    def until_received(self, meta: Any = None) -> KVConnectorOutput:
        """Steps (the first with `meta`) until one reports a finished load, which it returns."""
        out = self.run(meta)
        for _ in range(2000):  # a hang guard, not a timing check
            if out.finished_recving:
                return out
            assert not out.invalid_block_ids, "load errors come with the load's end"
            time.sleep(0.005)
            out = self.run()
        raise AssertionError("the load never finished")

    def saved(self, *rids: str) -> None:
        """Returns once the requests' saves are done: vLLM's wait before it takes a preempted
        request's blocks back (nothing is reported: that is the next step's)."""
        waits = threading.Thread(target=self.conn.handle_preemptions, args=(metadata(preempted=rids),),
                                 daemon=True)
        waits.start()
        waits.join(30)  # a hang guard, not a timing check
        assert not waits.is_alive(), f"the saves of {rids} never ended"


def settle(conn: OrbitKVConnector) -> None:
    """Waits until the scheduler side's calls to the Manager so far are done, releases too.
    Twice: a lookup given up gives its leases back when it ends, from the calls thread, and that
    release is queued behind a flush asked for while the lookup still ran."""
    assert conn._scheduler is not None
    conn._scheduler.flush()
    conn._scheduler.flush()


class Records(logging.Handler):
    """The connector's log records (vLLM's loggers do not propagate to pytest's capture)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, containing: str) -> List[str]:
        return [r.getMessage() for r in self.records if containing in r.getMessage()]


@pytest.fixture
def connectors(manager):
    """The connectors a test makes (`Connectors`), shut down after it, and the fake Manager
    then checked quiet: no lease held or released twice, no reservation open, no call held."""
    made = Connectors(manager)
    yield made
    made.shutdown_all()
    manager.assert_quiet()


@pytest.fixture
def log():
    """The connector's log records during the test."""
    records = Records()
    logger = logging.getLogger("vllm.orbitkv")
    logger.addHandler(records)
    yield records
    logger.removeHandler(records)
