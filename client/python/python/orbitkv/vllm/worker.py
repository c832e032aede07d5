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
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from vllm.logger import init_logger

from .. import ChunkKey, OrbitKVError, Region
from ._manager import Manager
from .config import ConfigError, Group, layout_name, namespaces, page_order, sync_loads
from .config import groups as kv_groups
from .scheduler import Part
from .stats import Counters

log = init_logger("vllm.orbitkv")

#: (kind, request id, each group's digests and block ids, a CUDA event the copy waits for or None)
Job = Tuple[str, str, List[Part], Any]


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
        outcomes: List[str] = self.client.save_blocks(self.regions, keys, blocks)
        return outcomes

    def load(self, keys: List[ChunkKey], blocks: List[int]) -> List[str]:
        outcomes: List[str] = self.client.load_blocks(self.regions, keys, blocks)
        return outcomes


class WorkerSide:
    def __init__(self, vllm_config: Any, ex: Dict[str, Any], groups: Optional[List[Group]] = None) -> None:
        self.vllm_config = vllm_config
        #: vLLM's KV cache groups (default: one of every layer): each has its layers, namespace
        #: and copies.
        self.groups = groups if groups is not None else kv_groups(vllm_config, None)
        #: Whether a group's blocks may be freed while the request runs (a sliding window
        #: leaves them): their saves are fenced against the blocks' reuse.
        self.windowed = {g.index for g in self.groups if g.kind != "full"}
        self.stats = Counters()
        self.rank = _tp_rank()
        self.manager = Manager(ex, f"vllm-worker-{self.rank}", self.stats)
        self.manager_extra = ex
        self.sync_loads = sync_loads(vllm_config, ex, self.groups)
        #: Who copies each group: `_HostCopies` for a CPU KV cache, `orbitkv.gpu.GpuBlockCopies`
        #: for a GPU one.
        self.copies: List[Any] = []
        self.gpu: List[Any] = []  # the GpuBlockCopies, for a GPU KV cache
        self.chunk_bytes: List[int] = []
        self.ns_ids: List[int] = []
        #: Blocks of windowed groups with a save queued or running (block id -> saves).
        self._fenced: Dict[int, int] = collections.Counter()
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
        #: With several KV cache groups, a load that failed is reported per request (block ids
        #: are per group): the requests whose loads failed, and those the last get_finished
        #: reported.
        self._failed_loads: Set[str] = set()
        self._reported_failed: Set[str] = set()
        self._busy = False
        self._stop = False
        self._refusals_logged: Set[str] = set()
        self._thread: Optional[threading.Thread] = None

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        layout = layout_name(self.vllm_config)
        use_mla = bool(getattr(self.vllm_config.model_config, "use_mla", False))
        devices = {t.device.type for t in kv_caches.values()}
        for g in self.groups:
            missing = [n for n in g.layer_names if n not in kv_caches]
            if missing:
                raise ConfigError(f"KV cache group {g.index}'s layer {missing[0]} has no KV cache tensor")
            # One group of every layer without a KV cache config: all of them, in vLLM's order.
            tensors = [kv_caches[n] for n in g.layer_names] if g.layer_names else list(kv_caches.values())
            if devices == {"cpu"}:
                for name, t in zip(g.layer_names or list(kv_caches), tensors):
                    if not t.is_contiguous():
                        raise ConfigError(f"KV cache of {name} is not contiguous (layout {layout})")
                regions = [Region(t, block_bytes=t[0].numel() * t.element_size()) for t in tensors]
                self.copies.append(_HostCopies(self.manager.client, regions))
                self.chunk_bytes.append(sum(r.block_bytes for r in regions))
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
                    copies = GpuBlockCopies(self.manager.client, cache, path, log, save_path=save_path)
                except OrbitKVError as e:
                    raise ConfigError(f"OrbitKV's kv_connector_extra_config: {e}") from None
                self.gpu.append(copies)
                self.copies.append(copies)
                self.chunk_bytes.append(cache.chunk_bytes)
                how = f"{cache.kind} pages on {cache.device}, gpu_path {path}, gpu_save_path {save_path}"
            else:
                raise ConfigError(f"KV cache tensors on {sorted(devices)}: OrbitKV copies CPU or CUDA KV caches")
        self.ns_ids = self.manager.register(namespaces(self.vllm_config, self.rank, layout, self.groups))
        for copies in self.gpu:
            try:
                copies.prepare()  # now if the Manager is up, else at the first copy
                self.manager.ok()
            except OrbitKVError as e:
                self.manager.failed(e, "register the GPU KV cache")
        log.info(
            "OrbitKV connector: %d layers in %d KV cache group(s) (%s), %s bytes per chunk (%s), "
            "namespace(s) %s (rank %d)",
            len(kv_caches), len(self.groups), ", ".join(g.tag for g in self.groups),
            "/".join(str(b) for b in self.chunk_bytes), how,
            ", ".join(f"{i:#x}" for i in self.ns_ids), self.rank,
        )
        self._thread = threading.Thread(target=self._run, name="orbitkv-copies", daemon=True)
        self._thread.start()

    def _event(self) -> Any:
        """For a GPU cache: an event after the work queued so far on the current stream (the
        forward pass writing the blocks to save, or still reading the blocks a load reuses)."""
        if not self.gpu:
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.gpu[0].cache.device))
        return ev

    # ---- the step's calls (forward thread)

    def start_loads(self, loads: Dict[str, List[Part]], fence: Sequence[int] = ()) -> None:
        """Before the step's forward pass: its loads, after any save still reading a block of
        a sliding window that this step writes (vLLM gave it out again, or a load fills it)."""
        if self._fenced:
            reused = set(fence)
            for parts in loads.values():
                for _, _, blocks in parts:
                    reused.update(blocks)
            with self._lock:
                if reused & self._fenced.keys():
                    self._lock.wait_for(lambda: not (reused & self._fenced.keys()) or self._stop)
        if self.sync_loads:
            # Before the forward pass that reads them; failures go to this step's
            # get_block_ids_with_load_errors (vLLM then recomputes from the first of them).
            for parts in loads.values():
                failed = {b for _, _, blocks in parts for b in blocks}
                try:
                    if self.gpu:
                        self._event().synchronize()
                    failed = self._load(parts)
                except Exception:
                    log.exception("OrbitKV load of %d blocks failed", len(failed))
                with self._lock:
                    self._load_errors |= failed
            return
        ev = self._event() if loads else None
        with self._lock:
            for rid, parts in loads.items():
                # Loads go before any saves queued: a request is waiting for them.
                self._jobs.appendleft(("load", rid, parts, ev))
            self._lock.notify()

    def start_saves(self, saves: Dict[str, List[Part]]) -> None:
        ev = self._event() if saves else None
        with self._lock:
            for rid, parts in saves.items():
                self._jobs.append(("save", rid, parts, ev))
                self._pending_saves[rid] += 1
                self._saved_reqs.add(rid)
                for b in self._windowed_blocks(parts):
                    self._fenced[b] += 1
            self._lock.notify()

    def _windowed_blocks(self, parts: List[Part]) -> List[int]:
        return [b for g, _, blocks in parts if g in self.windowed for b in blocks]

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
            self._reported_failed = self._failed_loads & recving
            self._failed_loads -= recving
        return (sending or None), (recving or None)

    def take_failed_loads(self) -> Set[str]:
        """The requests of the last get_finished whose loads failed (several KV cache groups)."""
        with self._lock:
            failed, self._reported_failed = self._reported_failed, set()
        return failed

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
            if not (self._thread is not None and self._thread.is_alive()):
                for copies in self.gpu:
                    copies.close()
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
                    for kind, rid, parts, _ in self._jobs:
                        if kind == "load":
                            self._load_failed(rid, {b for _, _, blocks in parts for b in blocks})
                            self._loads_done.add(rid)
                        else:
                            self._save_ended(rid, parts)
                    self._jobs.clear()
                    self._lock.notify_all()
                    return
                job = self._jobs.popleft()
                self._busy = True
            kind, rid, parts, ev = job
            # Until the load says otherwise, every block of it failed.
            failed = {b for _, _, blocks in parts for b in blocks}
            try:
                if ev is not None:
                    ev.synchronize()
                if kind == "load":
                    failed = self._load(parts)
                else:
                    self._save(parts)
            except Exception:
                # Whatever went wrong, the thread lives on: a load is reported failed (vLLM
                # recomputes), a save is dropped; the engine neither crashes nor waits forever.
                log.exception("OrbitKV %s of request %s failed", kind, rid)
            finally:
                with self._lock:
                    self._busy = False
                    if kind == "load":
                        self._load_failed(rid, failed)
                        self._loads_done.add(rid)
                    else:
                        self._save_ended(rid, parts)
                    self._lock.notify_all()

    def _load_failed(self, rid: str, blocks: Set[int]) -> None:
        """Under the lock: these blocks of the request's load failed (none: it did not)."""
        if not blocks:
            return
        if len(self.groups) > 1:
            self._failed_loads.add(rid)
        else:
            self._load_errors |= blocks

    def _save_ended(self, rid: str, parts: List[Part]) -> None:
        """Under the lock: a save job is done (or dropped)."""
        self._pending_saves[rid] -= 1
        for b in self._windowed_blocks(parts):
            self._fenced[b] -= 1
            if self._fenced[b] <= 0:
                del self._fenced[b]

    def _keys(self, group: int, digests: List[bytes]) -> List[ChunkKey]:
        ns = self.ns_ids[group]
        return [ChunkKey(ns, d) for d in digests]

    def _copies(self, group: int) -> Any:
        return self.copies[group]

    def _each_group(self, op: str, parts: List[Part]) -> Iterator[Tuple[int, List[int], Optional[List[str]]]]:
        """Runs `op` (load or save) of each group's part: (group, block ids, outcomes, None
        when the Manager could not be asked)."""
        for group, digests, blocks in parts:
            try:
                out = getattr(self._copies(group), op)(self._keys(group, digests), blocks)
                self.manager.ok()
            except OrbitKVError as e:
                self.manager.failed(e, op)
                out = None
            yield group, blocks, out

    def _load(self, parts: List[Part]) -> Set[int]:
        """Loads each group's chunks; the block ids that did not load."""
        t0 = time.perf_counter()
        failed: Set[int] = set()
        done = blocks_n = nbytes = 0
        outcomes: Set[str] = set()
        for group, blocks, out in self._each_group("load", parts):
            out = out if out is not None else ["failed"] * len(blocks)
            ok = sum(1 for o in out if o == "done")
            done += ok
            blocks_n += len(blocks)
            nbytes += ok * self.chunk_bytes[group]
            failed |= {b for b, o in zip(blocks, out) if o != "done"}
            outcomes |= set(out) - {"done"}
        self.stats.add(
            loaded_blocks=done,
            load_bytes=nbytes,
            load_seconds=time.perf_counter() - t0,
            load_error_blocks=len(failed),
        )
        if failed:
            log.warning("OrbitKV: %d of %d blocks did not load (%s); vLLM's kv_load_failure_policy applies",
                        len(failed), blocks_n, sorted(outcomes))
        return failed

    def _save(self, parts: List[Part]) -> None:
        t0 = time.perf_counter()
        stored = nbytes = blocks_n = 0
        refused: "collections.Counter[str]" = collections.Counter()
        for group, blocks, out in self._each_group("save", parts):
            if out is None:
                return  # the Manager is away: the other groups' saves would fail alike
            ok = sum(1 for o in out if o == "stored")
            stored += ok
            blocks_n += len(blocks)
            nbytes += ok * self.chunk_bytes[group]
            refused.update(o for o in out if o not in ("stored", "already_present"))
        self.stats.add(saved_blocks=stored, save_bytes=nbytes,
                       save_seconds=time.perf_counter() - t0, save_refused_blocks=sum(refused.values()))
        for why in refused:
            # A full Manager (no_space: its DRAM is leased out) or one whose limits refuse the
            # chunk: the blocks are not cached, the request goes on. Logged once per reason.
            if why not in self._refusals_logged:
                self._refusals_logged.add(why)
                log.warning("OrbitKV: the Manager refused %d of %d blocks to save (%s); they are not cached "
                            "(counted as save_refused_blocks; logged once per reason)",
                            refused[why], blocks_n, why)
