"""The scheduler side of the connector: lookups, leases, and which blocks each step loads and
saves. Runs in vLLM's engine-core process; its calls to the Manager run on a thread of their
own (`_calls.Calls`), so that a slow or stopped Manager never stalls vLLM's scheduler: a lookup
not answered within `lookup_wait` is asked again next step (vLLM's `None`), and one not answered
within `lookup_timeout` is a miss, logged once per outage and counted as `unavailable`."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from .. import ChunkKey, Lease, OrbitKVError, Timeout, chunk_digest
from ._calls import Calls
from ._manager import Manager
from .config import layout_name, namespace, seconds, sync_loads
from .stats import Counters

Work = Dict[str, Tuple[List[bytes], List[int]]]


@dataclasses.dataclass
class _Request:
    request: Any
    digests: List[bytes] = dataclasses.field(default_factory=list)
    #: Leases per TP rank on the blocks being loaded (held until the load has ended).
    leases: List[List[Lease]] = dataclasses.field(default_factory=list)
    #: Block range [start, end) the last lookup found, to load if the scheduler takes it.
    found: Optional[Tuple[int, int]] = None
    #: The lookup handed to the calls thread and not taken yet, and when it was asked.
    lookup: Optional["concurrent.futures.Future[List[List[Lease]]]"] = None
    lookup_since: float = 0.0
    loading: bool = False
    #: Blocks [0, saved) are in OrbitKV or sent to the workers for saving.
    saved: int = 0
    had_saves: bool = False
    finished: bool = False

    def extend_digests(self, n: int) -> None:
        """Our digests of the request's first `n` block hashes (its hashes grow as it runs)."""
        hashes = self.request.block_hashes
        self.digests.extend(chunk_digest(bytes(h)) for h in hashes[len(self.digests):n])


class SchedulerSide:
    def __init__(self, vllm_config: Any, ex: Dict[str, Any]) -> None:
        self.vllm_config = vllm_config
        self.block_size = int(vllm_config.cache_config.block_size)
        self.world = int(vllm_config.parallel_config.tensor_parallel_size)
        #: How long a lookup is waited for in the step that asks it (seconds), and after how
        #: long an unanswered one is given up as a miss.
        self.lookup_wait = seconds(ex, "lookup_wait", 0.02, zero_ok=True)
        self.lookup_timeout = seconds(ex, "lookup_timeout", 1.0)
        self.sync_loads = sync_loads(vllm_config, ex)
        #: Sync loads: the leases of each step's loads, given back once every step that may
        #: still be running them has ended (vLLM runs up to `max_concurrent_batches` at once).
        self._step_leases: Deque[List[List[Lease]]] = collections.deque()
        self._steps_in_flight = int(getattr(vllm_config, "max_concurrent_batches", 1) or 1) + 1
        self.stats = Counters()
        self.manager = Manager(ex, "vllm-scheduler", self.stats)
        self.calls = Calls()
        #: Namespace ids, registered by the calls thread (the only one that reads them).
        self._ns_ids: Optional[List[int]] = None
        self.reqs: Dict[str, _Request] = {}
        self.pending_loads: Work = {}
        #: Block ids of a request (bound by the connector to vLLM's KV cache manager).
        self.block_ids_of: Optional[Callable[[str], List[int]]] = None
        # The session opens now, off the scheduler's loop, so that the first lookups find it.
        self.calls.submit(self.ns_ids)

    def ns_ids(self) -> List[int]:
        """Every TP rank's namespace id (a prefix counts only where every rank has it)."""
        if self._ns_ids is None:
            layout = layout_name(self.vllm_config)
            descs = [namespace(self.vllm_config, r, layout) for r in range(self.world)]
            self._ns_ids = self.manager.register(descs)
        return self._ns_ids

    def _release(self, leases: List[List[Lease]]) -> None:
        """Gives leases back, on the calls thread (never waits)."""
        held = [lease for rank in leases for lease in rank]
        if not held:
            return

        def release() -> None:
            try:
                self.manager.client.release_deferred(held)
            except OrbitKVError as e:
                # Stale (the session they were taken in ended): the Manager already dropped them.
                if getattr(e, "kind", "") != "stale":
                    self.manager.failed(e, "release")

        self.calls.submit(release, bounded=False)

    def _lookup(self, digests: List[bytes]) -> List[List[Lease]]:
        """On the calls thread: leases on the longest prefix of `digests` each TP rank has."""
        ns_ids = self.ns_ids()
        leases: List[List[Lease]] = []
        limit = len(digests)
        for ns in ns_ids:
            got = self.manager.client.lookup_leased([ChunkKey(ns, d) for d in digests[:limit]])
            leases.append(got)
            limit = min(limit, len(got))
        self.manager.ok()
        return leases

    def _abandon(self, lookup: "concurrent.futures.Future[List[List[Lease]]]") -> None:
        """A lookup no request will use: not asked if it has not started, else its leases go
        back when it ends."""
        if lookup.cancel():
            return

        def give_back(f: "concurrent.futures.Future[List[List[Lease]]]") -> None:
            if not f.cancelled() and f.exception() is None:
                self._release(f.result())

        lookup.add_done_callback(give_back)

    def _ask(self, st: _Request, n: int) -> Optional[List[List[Lease]]]:
        """The leases of the request's lookup of its first `n` blocks: asked now if it has none
        under way; None while its answer is late (vLLM asks again next step). Raises
        `OrbitKVError` for a failed or given-up lookup."""
        if st.lookup is None:
            lookup = self.calls.submit(self._lookup, list(st.digests[:n]))
            if lookup is None:
                raise Timeout(f"{self.calls.queued} calls to the Manager are waiting")
            st.lookup, st.lookup_since, wait = lookup, time.monotonic(), self.lookup_wait
        else:
            wait = 0.0
        lookup = st.lookup
        try:
            leases = lookup.result(timeout=wait)
        except concurrent.futures.TimeoutError:
            if time.monotonic() - st.lookup_since < self.lookup_timeout:
                return None
            st.lookup = None
            self._abandon(lookup)
            raise Timeout(f"lookup not answered in {self.lookup_timeout:g} s") from None
        finally:
            if st.lookup is not None and st.lookup.done():
                st.lookup = None
        return leases

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        rid = request.request_id
        st = self.reqs.get(rid)
        if st is None:
            st = self.reqs[rid] = _Request(request)
        elif st.lookup is None:
            # Asked again (a preempted request coming back): its earlier leases go.
            st.request = request
            self._release(st.leases)
            st.leases, st.found = [], None
        hashes = list(request.block_hashes)
        local = num_computed_tokens // self.block_size
        if len(hashes) <= local and st.lookup is None:
            return 0, False
        st.extend_digests(len(hashes))
        try:
            got = self._ask(st, len(hashes))
        except OrbitKVError as e:
            self.manager.failed(e, "lookup")
            self.stats.add(lookups=1, miss_blocks=max(0, len(hashes) - local))
            return 0, False
        if got is None:
            return None, False
        leases = got
        limit = min([len(hashes)] + [len(rank) for rank in leases])
        if self.sync_loads:
            # The step must compute at least the prompt's last token (its logits give the next
            # one): a hit reaching the end of the prompt stops a block short. (vLLM does this
            # itself for async loads, recomputing the last token after the load.)
            num_tokens = int(getattr(request, "num_tokens", len(hashes) * self.block_size + 1))
            limit = min(limit, (num_tokens - 1) // self.block_size)
        # Keep the leases of the blocks to load, [local, limit); the others go back now (a
        # rank may hold more than `limit`, and the engine's own hit may reach past it).
        end = max(local, limit)
        self._release([rank[:local] + rank[end:] for rank in leases])
        self.stats.add(lookups=1, hit_blocks=end - local, miss_blocks=len(hashes) - end)
        if limit <= local:
            return 0, False
        st.leases = [rank[local:limit] for rank in leases]
        st.found = (local, limit)
        return (limit - local) * self.block_size, not self.sync_loads

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        st = self.reqs.setdefault(rid, _Request(request))
        st.request = request
        if st.found is None or st.loading:
            return
        start, end = st.found
        n = min(num_external_tokens // self.block_size, end - start)
        if n <= 0:
            # The scheduler did not take the hit: nothing to hold.
            self._release(st.leases)
            st.leases, st.found = [], None
            return
        block_ids = list(blocks.get_block_ids()[0])
        self.pending_loads[rid] = (st.digests[start:start + n], block_ids[start:start + n])
        self._release([rank[n:] for rank in st.leases])
        st.leases = [rank[:n] for rank in st.leases]
        st.loading = True
        st.saved = max(st.saved, start + n)

    def build_step(self, out: Any) -> Tuple[Work, Work, List[str]]:
        loads, self.pending_loads = self.pending_loads, {}
        if self.sync_loads:
            self._hand_over_sync_loads(loads)
        saves: Work = {}
        for rid, n_sched in (out.num_scheduled_tokens or {}).items():
            st = self.reqs.get(rid)
            if st is None or self.block_ids_of is None:
                continue
            req = st.request
            hashes = req.block_hashes
            full = min((req.num_computed_tokens + n_sched) // self.block_size, len(hashes))
            if full <= st.saved:
                continue
            st.extend_digests(full)
            ids = self.block_ids_of(rid)
            saves[rid] = (st.digests[st.saved:full], list(ids[st.saved:full]))
            st.saved = full
            st.had_saves = True
        return loads, saves, list(getattr(out, "preempted_req_ids", None) or ())

    def _hand_over_sync_loads(self, loads: Work) -> None:
        """Sync loads run in this step's forward pass: no `finished_recving` follows them. Their
        leases go back once the steps that may still run them have ended (the worker's copy
        takes leases of its own; these keep the chunks until it has)."""
        held: List[List[Lease]] = []
        for rid in loads:
            held.extend(self._load_ended(rid))
        self._step_leases.append(held)
        while len(self._step_leases) > self._steps_in_flight:
            self._release(self._step_leases.popleft())

    def _load_ended(self, rid: str) -> List[List[Lease]]:
        """The request's load has ended (or, sync, is handed to the step): its leases, for
        the caller to give back; a finished request with no saves is forgotten."""
        st = self.reqs.get(rid)
        if st is None:
            return []
        leases = st.leases
        st.leases, st.found, st.loading = [], None, False
        if st.finished and not st.had_saves:
            del self.reqs[rid]
        return leases

    def update_connector_output(self, output: Any) -> None:
        for rid in output.finished_recving or ():
            self._release(self._load_ended(rid))
        for rid in output.finished_sending or ():
            st = self.reqs.get(rid)
            if st is not None and st.finished and not st.loading:
                del self.reqs[rid]

    def request_finished(self, request: Any, block_ids: List[int]) -> bool:
        """Whether vLLM must keep the request's blocks until the workers report its saves."""
        st = self.reqs.get(request.request_id)
        if st is None:
            return False
        st.finished = True
        if st.lookup is not None:
            self._abandon(st.lookup)
            st.lookup = None
        if not st.loading:
            self._release(st.leases)
            st.leases, st.found = [], None
            if not st.had_saves:
                del self.reqs[request.request_id]
        return st.had_saves

    def flush(self, timeout: float = 10.0) -> None:
        """Waits until every call handed to the Manager so far is done, deferred releases
        answered too."""
        self.calls.submit(self.manager.client.flush, bounded=False).result(timeout)

    def shutdown(self) -> None:
        while self._step_leases:
            self._release(self._step_leases.popleft())
        for st in self.reqs.values():
            if st.lookup is not None:
                self._abandon(st.lookup)
            self._release(st.leases)
        try:
            self.flush(timeout=5.0)
        except (OrbitKVError, concurrent.futures.TimeoutError):
            pass
        self.calls.close()
