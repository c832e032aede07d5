"""`OrbitKVConnector`: vLLM's `KVConnectorBase_V1` backed by the host's OrbitKV Manager.

One chunk is one vLLM block of every layer of one TP rank, keyed by vLLM's own chained block
hash (`request.block_hashes`, mapped by `orbitkv.chunk_digest`) in the rank's namespace. With
vLLM's hybrid KV cache manager (`SupportsHMA`: sliding-window or chunked local attention beside
full attention) a chunk is one block of one KV cache group's layers, in a namespace of that
group; a sliding window's blocks are saved while the request attends to them and only those a
request still attends to are loaded. A hit is reported only for a prefix every group can
restore. KV cache groups that are not paged attention KV (Mamba / linear-attention state) are
refused at start (`config.groups`).

P/D (`role` in the extra config): `prefill` (or `both`, the default) looks up, loads and saves;
`decode` only saves (its KV comes from the prefill instance through the P/D connector beside
OrbitKV in vLLM's `MultiConnector`).

Scheduler side: a lookup leases the longest prefix every TP rank has; the hit is reported as
an async load and the lease holds the chunks until the worker has loaded them (or the request
is dropped). Newly computed full blocks are sent to the workers for saving; a finished request
keeps its blocks until their saves are done.

Worker side: a background thread copies between the engine's KV cache and the Manager's arena
(loads first, saves never on the forward pass): CPU caches by the engine process; GPU caches'
loads by the Manager's DMA threads (by the engine process where the Manager cannot open them),
their saves by the engine process unless `gpu_save_path` says otherwise. Loads that fail are
reported per block (`get_block_ids_with_load_errors`), for vLLM's `kv_load_failure_policy`.

The engine never fails because of the cache: a Manager that is down or restarting makes misses
(logged once, counted as `unavailable`), and the clients reconnect with backoff.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger

from . import stats as _stats
from .config import check_hashing, extra, groups
from .config import role as role_of
from .scheduler import SchedulerSide, Work
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch

log = init_logger("vllm.orbitkv")


@dataclasses.dataclass
class OrbitKVConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers (plain values: it crosses processes).

    loads: request id -> [(KV cache group, chunk digests, block ids)] to load.
    saves: request id -> [(KV cache group, chunk digests, block ids)] to save.
    preempted: requests whose blocks are being taken back (their saves must end first).
    fence: blocks vLLM gave out this step (with a sliding-window group: a save still reading
        one of them ends before the forward pass writes it).
    """

    loads: Work = dataclasses.field(default_factory=dict)
    saves: Work = dataclasses.field(default_factory=dict)
    preempted: List[str] = dataclasses.field(default_factory=list)
    fence: List[int] = dataclasses.field(default_factory=list)


class OrbitKVConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docs. Extra config (`kv_connector_extra_config`): `socket` (default: the
    Manager's default socket), `namespace_model` (the model name in the namespace; default the
    served model name), `request_timeout` (seconds, default 10), `lookup_wait` (seconds the
    scheduler waits for a lookup in its step, default 0.02), `lookup_timeout` (seconds after
    which an unanswered lookup is a miss, default 1), `load_mode` (`auto`, `sync` or `async`:
    loads done before the forward pass of the step that schedules them, or while the request
    waits; default `auto`: sync for CPU KV caches), `gpu_path` (`auto`, `server`
    or `engine`: who copies a GPU KV cache; default `auto`), `gpu_save_path` (who copies its
    saves; default `engine` when `gpu_path` is `auto`, else `gpu_path`), `role` (`both`,
    `prefill` or `decode`: see the module docs; default `both`)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_hashing(vllm_config)
        ex = extra(vllm_config)
        pd_role = role_of(ex)
        gs = groups(vllm_config, kv_cache_config)
        self._scheduler: Optional[SchedulerSide] = None
        self._worker: Optional[WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(vllm_config, ex, gs, lookups=pd_role != "decode")
        else:
            self._worker = WorkerSide(vllm_config, ex, gs)

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM >= 0.34: how the workers reach a GPU KV cache. `gpu_path` or `gpu_save_path`
        `server`: the Manager imports the engine's allocation by legacy CUDA IPC, which vLLM's
        extensible KV cache cannot give; otherwise in-process copies (`auto` copies by the engine
        when the Manager cannot import the allocation)."""
        from vllm.config.kv_transfer import KVCacheAccess

        ex = dict(getattr(kv_transfer_config, "kv_connector_extra_config", None) or {})
        if "server" in (ex.get("gpu_path"), ex.get("gpu_save_path")):
            return KVCacheAccess.LEGACY_IPC
        return KVCacheAccess.IN_PROCESS

    # OrbitKV is a cache: a request never waits for its KV to be delivered anywhere.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ----------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        if self._scheduler.block_ids_of is None and self._kv_cache_manager is not None:
            manager = self._kv_cache_manager
            self._scheduler.block_ids_of = manager.get_block_ids
        loads, saves, preempted, fence = self._scheduler.build_step(scheduler_output)
        return OrbitKVConnectorMetadata(loads=loads, saves=saves, preempted=preempted, fence=fence)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request), None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: Tuple[List[int], ...]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        # Every group's blocks stay until the request's saves are done (get_finished).
        assert self._scheduler is not None
        return self._scheduler.request_finished(request), None

    # ----------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: Dict[str, "torch.Tensor"]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, OrbitKVConnectorMetadata):
            self._worker.wait_for(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, OrbitKVConnectorMetadata)
        self._worker.start_loads(meta.loads, meta.fence)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Sync loads are done in start_load_kv, before the forward pass; an async load's
        # request is not in the batch until its blocks are in place: no layer waits here.
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        # A chunk holds every layer of a block: blocks are saved once the step's forward pass
        # has written all layers (wait_for_save), off the forward pass.
        return None

    def wait_for_save(self) -> None:
        assert self._worker is not None
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, OrbitKVConnectorMetadata)
            self._worker.start_saves(meta.saves)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        # A failed load of a model with several KV cache groups is reported per request.
        assert self._worker is not None
        sending, recving = self._worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=self._worker.take_failed_loads())

    def get_block_ids_with_load_errors(self) -> Set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        side = self._scheduler or self._worker
        if side is not None:
            name = "scheduler" if self._scheduler is not None else "worker"
            log.info("OrbitKV connector totals (%s): %s", name, json.dumps(side.stats.totals()))
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ----------------------------------------------------------------- both

    def get_kv_connector_stats(self) -> Optional[_stats.OrbitKVConnectorStats]:
        side = self._scheduler or self._worker
        taken = side.stats.take() if side is not None else None
        return None if taken is None or taken.is_empty() else taken

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> _stats.OrbitKVConnectorStats:
        return _stats.build(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> _stats.OrbitKVPromMetrics:
        return _stats.OrbitKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
