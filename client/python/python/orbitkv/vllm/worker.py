"""The worker side of the connector: copies between the engine's KV cache and the Manager's
arena, on a background thread so that the forward pass never waits for them.

CPU KV caches are copied by this process straight into and out of the arena. GPU KV caches
(vLLM >= 0.32's per-layer `[blocks, heads, tokens, content]` views, per layer or cross-layer,
MLA included) are loaded by the Manager's DMA threads (registered with it), or by this process
through its CUDA-registered mapping of the arena when the Manager cannot open them (`gpu_path`:
`auto`, `server` or `engine`); saves go by `gpu_save_path`, by default this process's own copies
when `gpu_path` is `auto` (see `orbitkv.gpu.GpuBlockCopies`)."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Set, Tuple

from vllm.logger import init_logger

from .. import ChunkKey, OrbitKVError, Region
from ._manager import Manager
from .config import ConfigError, layout_name, namespace, page_order, sync_loads
from .stats import Counters

log = init_logger("vllm.orbitkv")

#: (kind, request id, digests, block ids, a CUDA event the copy waits for or None)
Job = Tuple[str, str, List[bytes], List[int], Any]


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no TP group: a single rank
        return 0


class _HostCopies:
    """A CPU KV cache: its blocks copied by this process straight to and from the arena."""

    def __init__(self, client: Any, regions: List[Region]) -> None:
        self.client = client
        self.regions = regions

    def save(self, keys: List[ChunkKey], blocks: List[int]) -> List[str]:
        return self.client.save_blocks(self.regions, keys, blocks)

    def load(self, keys: List[ChunkKey], blocks: List[int]) -> List[str]:
        return self.client.load_blocks(self.regions, keys, blocks)


class WorkerSide:
    def __init__(self, vllm_config: Any, ex: Dict[str, Any]) -> None:
        self.vllm_config = vllm_config
        self.stats = Counters()
        self.rank = _tp_rank()
        self.manager = Manager(ex, f"vllm-worker-{self.rank}", self.stats)
        self.manager_extra = ex
        self.sync_loads = sync_loads(vllm_config, ex)
        #: Who copies: `_HostCopies` for a CPU KV cache, `orbitkv.gpu.GpuBlockCopies` for a GPU one.
        self.copies: Any = None
        self.gpu: Any = None  # the GpuBlockCopies, for a GPU KV cache
        self.chunk_bytes = 0
        self.ns_id: Optional[int] = None
        self._lock = threading.Condition()
        self._jobs: Deque[Job] = collections.deque()
        self._pending_saves: Dict[str, int] = collections.Counter()
        self._saved_reqs: Set[str] = set()
        self._finishing: Set[str] = set()
        self._loads_done: Set[str] = set()
        self._load_errors: Set[int] = set()
        #: Failed blocks of the loads the last get_finished reported, for this step's
        #: get_block_ids_with_load_errors (vLLM asks for them right after).
        self._reported_errors: Set[int] = set()
        self._busy = False
        self._stop = False
        self._refusals_logged: Set[str] = set()
        self._thread: Optional[threading.Thread] = None

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        tensors = list(kv_caches.values())
        layout = layout_name(self.vllm_config)
        use_mla = bool(getattr(self.vllm_config.model_config, "use_mla", False))
        devices = {t.device.type for t in tensors}
        if devices == {"cpu"}:
            for name, t in kv_caches.items():
                if not t.is_contiguous():
                    raise ConfigError(f"KV cache of {name} is not contiguous (layout {layout})")
            regions = [Region(t, block_bytes=t[0].numel() * t.element_size()) for t in tensors]
            self.copies = _HostCopies(self.manager.client, regions)
            self.chunk_bytes = sum(r.block_bytes for r in regions)
            how = "copied by this process"
        elif devices == {"cuda"}:
            from ..gpu import GpuBlockCopies, GpuKvCache

            try:
                cache = GpuKvCache(tensors, mla=use_mla)
            except OrbitKVError as e:
                raise ConfigError(f"OrbitKV cannot copy this KV cache (layout {layout}): {e}") from None
            if not use_mla and not cache.matches(page_order(layout)):
                raise ConfigError(f"the KV cache's pages are {cache.page_order} but vLLM's layout is {layout}")
            path = str(self.manager_extra.get("gpu_path", "auto"))
            save_path = str(self.manager_extra.get("gpu_save_path", "engine" if path == "auto" else path))
            try:
                self.gpu = self.copies = GpuBlockCopies(self.manager.client, cache, path, log, save_path=save_path)
            except OrbitKVError as e:
                raise ConfigError(f"OrbitKV's kv_connector_extra_config: {e}") from None
            self.chunk_bytes = cache.chunk_bytes
            how = f"{cache.kind} pages on {cache.device}, gpu_path {path}, gpu_save_path {save_path}"
        else:
            raise ConfigError(f"KV cache tensors on {sorted(devices)}: OrbitKV copies CPU or CUDA KV caches")
        desc = namespace(self.vllm_config, self.rank, layout)
        (self.ns_id,) = self.manager.register([desc])
        if self.gpu is not None:
            try:
                self.gpu.prepare()  # now if the Manager is up, else at the first copy
                self.manager.ok()
            except OrbitKVError as e:
                self.manager.failed(e, "register the GPU KV cache")
        log.info(
            "OrbitKV connector: %d layers, %d bytes per chunk (%s), namespace %#x (rank %d)",
            len(tensors), self.chunk_bytes, how, self.ns_id, self.rank,
        )
        self._thread = threading.Thread(target=self._run, name="orbitkv-copies", daemon=True)
        self._thread.start()

    def _event(self) -> Any:
        """For a GPU cache: an event after the work queued so far on the current stream (the
        forward pass writing the blocks to save, or still reading the blocks a load reuses)."""
        if self.gpu is None:
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.gpu.cache.device))
        return ev

    # ---- the step's calls (forward thread)

    def start_loads(self, loads: Dict[str, Tuple[List[bytes], List[int]]]) -> None:
        if self.sync_loads:
            # Before the forward pass that reads them; failures go to this step's
            # get_block_ids_with_load_errors (vLLM then recomputes from the first of them).
            for digests, blocks in loads.values():
                failed = set(blocks)
                try:
                    if self.gpu is not None:
                        self._event().synchronize()
                    failed = self._load(digests, blocks)
                except Exception:
                    log.exception("OrbitKV load of %d blocks failed", len(blocks))
                with self._lock:
                    self._load_errors |= failed
            return
        ev = self._event() if loads else None
        with self._lock:
            for rid, (digests, blocks) in loads.items():
                # Loads go before any saves queued: a request is waiting for them.
                self._jobs.appendleft(("load", rid, digests, blocks, ev))
            self._lock.notify()

    def start_saves(self, saves: Dict[str, Tuple[List[bytes], List[int]]]) -> None:
        ev = self._event() if saves else None
        with self._lock:
            for rid, (digests, blocks) in saves.items():
                self._jobs.append(("save", rid, digests, blocks, ev))
                self._pending_saves[rid] += 1
                self._saved_reqs.add(rid)
            self._lock.notify()

    def wait_for(self, rids: List[str]) -> None:
        """Returns once no save of `rids` is queued or running (their blocks are taken back)."""
        if not rids:
            return
        with self._lock:
            self._lock.wait_for(lambda: all(self._pending_saves.get(r, 0) == 0 for r in rids) or self._stop)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        with self._lock:
            self._finishing |= set(finished_req_ids) & self._saved_reqs
            sending = {r for r in self._finishing if self._pending_saves.get(r, 0) == 0}
            self._finishing -= sending
            self._saved_reqs -= sending
            for r in sending:
                self._pending_saves.pop(r, None)
            recving, self._loads_done = self._loads_done, set()
            self._reported_errors = self._load_errors
            self._load_errors = set()
        return (sending or None), (recving or None)

    def take_load_errors(self) -> Set[int]:
        with self._lock:
            errors, self._reported_errors = self._reported_errors, set()
        return errors

    def shutdown(self) -> None:
        with self._lock:
            self._lock.wait_for(lambda: not self._jobs and not self._busy, timeout=30)
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            # Not while a copy may still be running (the thread stops after its current job).
            if self.gpu is not None and not (self._thread is not None and self._thread.is_alive()):
                self.gpu.close()
            self.manager.client.flush()
        except OrbitKVError:
            pass

    # ---- the copy thread

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._jobs or self._stop)
                if self._stop:
                    # Whatever is still queued is dropped: loads count as failed (vLLM
                    # recomputes), saves are not made.
                    for kind, rid, _, blocks, _ in self._jobs:
                        if kind == "load":
                            self._load_errors |= set(blocks)
                            self._loads_done.add(rid)
                        else:
                            self._pending_saves[rid] -= 1
                    self._jobs.clear()
                    self._lock.notify_all()
                    return
                job = self._jobs.popleft()
                self._busy = True
            kind, rid, digests, blocks, ev = job
            # Until the load says otherwise, every block of it failed.
            failed = set(blocks)
            try:
                if ev is not None:
                    ev.synchronize()
                if kind == "load":
                    failed = self._load(digests, blocks)
                else:
                    self._save(digests, blocks)
            except Exception:
                # Whatever went wrong, the thread lives on: a load is reported failed (vLLM
                # recomputes), a save is dropped; the engine neither crashes nor waits forever.
                log.exception("OrbitKV %s of request %s failed", kind, rid)
            finally:
                with self._lock:
                    self._busy = False
                    if kind == "load":
                        self._load_errors |= failed
                        self._loads_done.add(rid)
                    else:
                        self._pending_saves[rid] -= 1
                    self._lock.notify_all()

    def _keys(self, digests: List[bytes]) -> List[ChunkKey]:
        assert self.ns_id is not None
        return [ChunkKey(self.ns_id, d) for d in digests]

    def _load(self, digests: List[bytes], blocks: List[int]) -> Set[int]:
        """Loads the chunks; the block ids that did not load."""
        t0 = time.perf_counter()
        try:
            out = self.copies.load(self._keys(digests), blocks)
            self.manager.ok()
        except OrbitKVError as e:
            self.manager.failed(e, "load")
            out = ["failed"] * len(blocks)
        done = sum(1 for o in out if o == "done")
        failed = {b for b, o in zip(blocks, out) if o != "done"}
        self.stats.add(
            loaded_blocks=done,
            load_bytes=done * self.chunk_bytes,
            load_seconds=time.perf_counter() - t0,
            load_error_blocks=len(failed),
        )
        if failed:
            log.warning("OrbitKV: %d of %d blocks did not load (%s); vLLM's kv_load_failure_policy applies",
                        len(failed), len(blocks), sorted(set(out) - {"done"}))
        return failed

    def _save(self, digests: List[bytes], blocks: List[int]) -> None:
        t0 = time.perf_counter()
        try:
            out = self.copies.save(self._keys(digests), blocks)
            self.manager.ok()
        except OrbitKVError as e:
            self.manager.failed(e, "save")
            return
        stored = sum(1 for o in out if o == "stored")
        refused = collections.Counter(o for o in out if o not in ("stored", "already_present"))
        self.stats.add(saved_blocks=stored, save_bytes=stored * self.chunk_bytes,
                       save_seconds=time.perf_counter() - t0, save_refused_blocks=sum(refused.values()))
        for why in refused:
            # A full Manager (no_space: its DRAM is leased out) or one whose limits refuse the
            # chunk: the blocks are not cached, the request goes on. Logged once per reason.
            if why not in self._refusals_logged:
                self._refusals_logged.add(why)
                log.warning("OrbitKV: the Manager refused %d of %d blocks to save (%s); they are not cached "
                            "(counted as save_refused_blocks; logged once per reason)",
                            refused[why], len(blocks), why)
