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
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

from .. import ChunkKey, Lease, OrbitKVError, Timeout, chunk_digest
from ._calls import Calls
from ._manager import Manager
from .config import Group, layout_name, namespaces, seconds, sync_loads
from .config import groups as kv_groups
from .stats import Counters

#: One group's part of a request's step: (group index, chunk digests, block ids).
Part = Tuple[int, List[bytes], List[int]]
#: Request id -> its parts to load or save this step.
Work = Dict[str, List[Part]]
#: A lease held for a request: (TP rank, group index, block index, lease).
Held = Tuple[int, int, int, Lease]

#: vLLM's null block (the place of a block a sliding window has left): never copied.
NULL_BLOCK = 0
#: How many times a lookup narrows its prefix to find one every sliding window holds.
WINDOW_TRIES = 4


@dataclasses.dataclass
class _Request:
    request: Any
    digests: List[bytes] = dataclasses.field(default_factory=list)
    #: Leases on the blocks being loaded (held until the load has ended).
    leases: List[Held] = dataclasses.field(default_factory=list)
    #: Block range [start, end) the last lookup found, to load if the scheduler takes it.
    found: Optional[Tuple[int, int]] = None
    #: The lookup handed to the calls thread and not taken yet, and when it was asked.
    lookup: Optional["concurrent.futures.Future[Tuple[int, List[Held]]]"] = None
    lookup_since: float = 0.0
    loading: bool = False
    #: Blocks [0, saved) are in OrbitKV or sent to the workers for saving.
    saved: int = 0
    had_saves: bool = False
    finished: bool = False
    #: Its load failed (reported per request with several KV cache groups, else as invalid
    #: blocks of its load): vLLM recomputes it, and it is not looked up again.
    load_failed: bool = False

    def extend_digests(self, n: int) -> None:
        """Our digests of the request's first `n` block hashes (its hashes grow as it runs)."""
        hashes = self.request.block_hashes
        self.digests.extend(chunk_digest(bytes(h)) for h in hashes[len(self.digests):n])


class SchedulerSide:
    def __init__(self, vllm_config: Any, ex: Dict[str, Any], groups: Optional[List[Group]] = None,
                 lookups: bool = True) -> None:
        self.vllm_config = vllm_config
        #: vLLM's KV cache groups (default: one of every layer); a hit needs every group's
        #: blocks the request attends to.
        self.groups = groups if groups is not None else kv_groups(vllm_config, None)
        #: False for a save-only connector (P/D's decode role): no lookup is ever made.
        self.lookups = lookups
        self.block_size = int(vllm_config.cache_config.block_size)
        self.world = int(vllm_config.parallel_config.tensor_parallel_size)
        #: How long a lookup is waited for in the step that asks it (seconds), and after how
        #: long an unanswered one is given up as a miss.
        self.lookup_wait = seconds(ex, "lookup_wait", 0.02, zero_ok=True)
        self.lookup_timeout = seconds(ex, "lookup_timeout", 1.0)
        self.sync_loads = sync_loads(vllm_config, ex, self.groups)
        #: Sync loads: the leases of each step's loads, given back once every step that may
        #: still be running them has ended (vLLM runs up to `max_concurrent_batches` at once).
        self._step_leases: Deque[List[Held]] = collections.deque()
        self._steps_in_flight = int(getattr(vllm_config, "max_concurrent_batches", 1) or 1) + 1
        self.stats = Counters()
        self.manager = Manager(ex, "vllm-scheduler", self.stats)
        self.calls = Calls()
        #: Namespace ids [rank][group], registered by the calls thread (the only one that reads them).
        self._ns_ids: Optional[List[List[int]]] = None
        self.reqs: Dict[str, _Request] = {}
        self.pending_loads: Work = {}
        #: Requests whose load's outcome is not in yet, with the engine blocks it writes: an
        #: invalid block among them means the load failed.
        self._load_blocks: Dict[str, Set[int]] = {}
        #: Block ids of a request, per group (bound by the connector to vLLM's KV cache manager).
        self.block_ids_of: Optional[Callable[[str], Sequence[Sequence[int]]]] = None
        # The session opens now, off the scheduler's loop, so that the first lookups find it.
        self.calls.submit(self.ns_ids)

    def ns_ids(self) -> List[List[int]]:
        """Every TP rank's namespace id of each group (a prefix counts only where every rank
        and group has it)."""
        if self._ns_ids is None:
            layout = layout_name(self.vllm_config)
            ids = self.manager.register([d for r in range(self.world)
                                         for d in namespaces(self.vllm_config, r, layout, self.groups)])
            per = len(ids) // self.world
            self._ns_ids = [ids[r * per:(r + 1) * per] for r in range(self.world)]
        return self._ns_ids

    def _release(self, leases: Sequence[Held]) -> None:
        """Gives leases back, on the calls thread (never waits)."""
        held = [h[3] for h in leases]
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

    def _lookup(self, digests: List[bytes]) -> Tuple[int, List[Held]]:
        """On the calls thread: the longest prefix of `digests` every TP rank and group can
        restore, and the leases taken on the way (the caller keeps those it loads).

        A full-attention group needs every block of the prefix; a windowed one only the blocks
        the request still attends to at its end (`Group.first_needed`): when one of those is
        missing, the prefix is cut before it and the windows are looked up again."""
        ns_ids = self.ns_ids()
        client = self.manager.client
        held: List[Held] = []
        limit = len(digests)

        def leased(rank: int, g: Group, start: int, end: int) -> int:
            keys = [ChunkKey(ns_ids[rank][g.index], d) for d in digests[start:end]]
            got = client.lookup_leased(keys) if keys else []
            held.extend((rank, g.index, start + i, lease) for i, lease in enumerate(got))
            return start + len(got)

        for g in self.groups:
            if g.kind == "full":
                for rank in range(self.world):
                    limit = min(limit, leased(rank, g, 0, limit))
        windowed = [g for g in self.groups if g.kind != "full"]
        for _ in range(WINDOW_TRIES if windowed else 1):
            cut = limit
            for g in windowed:
                start = g.first_needed(limit)
                for rank in range(self.world):
                    cut = min(cut, leased(rank, g, start, limit))
            if cut == limit:
                break
            limit = cut
        else:
            limit = 0
        self.manager.ok()
        return limit, held

    def _abandon(self, lookup: "concurrent.futures.Future[Tuple[int, List[Held]]]") -> None:
        """A lookup no request will use: not asked if it has not started, else its leases go
        back when it ends."""
        if lookup.cancel():
            return

        def give_back(f: "concurrent.futures.Future[Tuple[int, List[Held]]]") -> None:
            if not f.cancelled() and f.exception() is None:
                self._release(f.result()[1])

        lookup.add_done_callback(give_back)

    def _ask(self, st: _Request, n: int) -> Optional[Tuple[int, List[Held]]]:
        """The answer of the request's lookup of its first `n` blocks: asked now if it has none
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
        if not self.lookups:
            return 0, False
        rid = request.request_id
        st = self.reqs.get(rid)
        if st is None:
            st = self.reqs[rid] = _Request(request)
        elif st.load_failed:
            return 0, False
        elif st.lookup is None:
            # Asked again (a preempted request coming back): its earlier leases go.
            st.request = request
            self._release(st.leases)
            st.leases, st.found = [], None
        hashes = list(request.block_hashes)
        local = num_computed_tokens // self.block_size
        if len(hashes) <= local and st.lookup is None:
            return 0, False
        wanted = len(hashes)
        if self.sync_loads:
            # The step must compute at least the prompt's last token (its logits give the next
            # one): a hit reaching the end of the prompt stops a block short. (vLLM does this
            # itself for async loads, recomputing the last token after the load.) The cut comes
            # before the lookup: a sliding window is looked up at the hit's end.
            num_tokens = int(getattr(request, "num_tokens", len(hashes) * self.block_size + 1))
            wanted = min(wanted, (num_tokens - 1) // self.block_size)
        if wanted <= local and st.lookup is None:
            self.stats.add(lookups=1, miss_blocks=len(hashes) - local)
            return 0, False
        st.extend_digests(len(hashes))
        try:
            got = self._ask(st, wanted)
        except OrbitKVError as e:
            self.manager.failed(e, "lookup")
            self.stats.add(lookups=1, miss_blocks=max(0, len(hashes) - local))
            return 0, False
        if got is None:
            return None, False
        limit, held = got
        limit = min(limit, wanted)
        # Keep the leases of the blocks to load; the others go back now (a rank may hold
        # more than `limit`, and the engine's own hit may reach past it).
        keep = self._needed(held, local, limit)
        self._release([h for h in held if id(h) not in keep])
        end = max(local, limit)
        self.stats.add(lookups=1, hit_blocks=end - local, miss_blocks=len(hashes) - end)
        if limit <= local:
            return 0, False
        st.leases = [h for h in held if id(h) in keep]
        st.found = (local, limit)
        return (limit - local) * self.block_size, not self.sync_loads

    def _needed(self, held: Sequence[Held], start: int, end: int) -> Set[int]:
        """The leases (by id) a hit of blocks [start, end) loads: one per rank, group and block
        the request attends to at `end`."""
        first = {g.index: max(start, g.first_needed(end)) for g in self.groups}
        keep: Dict[Tuple[int, int, int], int] = {}
        for h in held:
            rank, g, b, _ = h
            if first[g] <= b < end:
                keep.setdefault((rank, g, b), id(h))
        return set(keep.values())

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
        # Every group's blocks vLLM allocated for the hit are loaded; the ones a sliding window
        # has already left are vLLM's null block (nothing to load there).
        ids_of = blocks.get_block_ids()
        parts: List[Part] = []
        loaded: Set[Tuple[int, int]] = set()
        for g in self.groups:
            ids = ids_of[g.index]
            idx = [b for b in range(start, start + n) if ids[b] != NULL_BLOCK]
            if idx:
                parts.append((g.index, [st.digests[b] for b in idx], [ids[b] for b in idx]))
                loaded.update((g.index, b) for b in idx)
        self.pending_loads[rid] = parts
        self._load_blocks[rid] = {b for _, _, ids in parts for b in ids}
        self._release([h for h in st.leases if (h[1], h[2]) not in loaded])
        st.leases = [h for h in st.leases if (h[1], h[2]) in loaded]
        st.loading = True
        st.saved = max(st.saved, start + n)

    def build_step(self, out: Any) -> Tuple[Work, Work, List[str], List[int]]:
        """This step's loads and saves, the requests preempted, and (with a windowed group)
        the blocks vLLM gave out this step: a block a sliding window has left may be one of
        them while the workers still save it, and they finish that save first."""
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
            ids_of = self.block_ids_of(rid)
            parts: List[Part] = []
            for g in self.groups:
                ids = ids_of[g.index]
                idx = [b for b in range(st.saved, full) if ids[b] != NULL_BLOCK]
                if idx:
                    parts.append((g.index, [st.digests[b] for b in idx], [ids[b] for b in idx]))
            if parts:
                saves[rid] = parts
                st.had_saves = True
            st.saved = full
        fence: List[int] = []
        if any(g.kind != "full" for g in self.groups):
            fence = new_block_ids(out)
        return loads, saves, list(getattr(out, "preempted_req_ids", None) or ()), fence

    def _hand_over_sync_loads(self, loads: Work) -> None:
        """Sync loads run in this step's forward pass: no `finished_recving` follows them. Their
        leases go back once the steps that may still run them have ended (the worker's copy
        takes leases of its own; these keep the chunks until it has)."""
        held: List[Held] = []
        for rid in loads:
            held.extend(self._load_ended(rid))
        self._step_leases.append(held)
        while len(self._step_leases) > self._steps_in_flight:
            self._release(self._step_leases.popleft())

    def _load_ended(self, rid: str) -> List[Held]:
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
        for rid in getattr(output, "failed_recving", None) or ():
            st = self.reqs.get(rid)
            if st is not None:
                st.load_failed = True
        # One KV cache group: a failed load shows as invalid blocks. vLLM recomputes from the
        # first; if that is the request's first block it asks the connector again, and the
        # same hit must not come back (it would fail the same way, again and again).
        invalid = getattr(output, "invalid_block_ids", None)
        if invalid:
            for rid, blocks in self._load_blocks.items():
                st = self.reqs.get(rid)
                if st is not None and not blocks.isdisjoint(invalid):
                    st.load_failed = True
        for rid in output.finished_recving or ():
            self._release(self._load_ended(rid))
        # A load's outcome is in once it is no longer running (async: finished above; sync:
        # it ran in the step this output reports).
        for rid in [r for r in self._load_blocks if r not in self.reqs or not self.reqs[r].loading]:
            del self._load_blocks[rid]
        for rid in output.finished_sending or ():
            st = self.reqs.get(rid)
            if st is not None and st.finished and not st.loading:
                del self.reqs[rid]

    def request_finished(self, request: Any) -> bool:
        """Whether vLLM must keep the request's blocks (of every group) until the workers
        report its saves."""
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


def new_block_ids(out: Any) -> List[int]:
    """Every block vLLM gave a request in this step's scheduler output, of every group."""
    ids: List[int] = []
    for req in getattr(out, "scheduled_new_reqs", None) or ():
        for group in req.block_ids or ():
            ids.extend(group)
    cached = getattr(out, "scheduled_cached_reqs", None)
    for new in getattr(cached, "new_block_ids", None) or ():
        for group in new or ():
            ids.extend(group)
    return ids
