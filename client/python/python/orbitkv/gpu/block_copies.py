"""`GpuBlockCopies`: blocks of a `GpuKvCache` saved and loaded by the Manager's DMA threads
or by this process, whichever path is configured or available."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from .._native import InvalidArgument, Stale
from .engine_copies import EngineCopies
from .ipc import device_uuid
from .kv_cache import GpuKvCache


class GpuBlockCopies:
    """Saves and loads blocks of a `GpuKvCache` through `client`, each direction by one of two
    paths:

    - `server`: the cache is registered with the Manager (CUDA IPC) and its DMA threads copy;
      the registration is renewed after a Manager restart;
    - `engine`: this process copies through its CUDA-registered mapping of the arena
      (`EngineCopies`), for containers without CUDA IPC between engine and Manager;
    - `auto`: `server`, and `engine` for good if the Manager refuses the registration (no GPU
      mode there, IPC not possible, memory CUDA IPC cannot share).

    `path` (default `auto`) is the loads' path, and the saves' unless `save_path` names
    another. Why saves may want another: the Manager's copies run in its own CUDA context, and
    without MPS the GPU time-slices contexts, so the engine's kernels wait while the Manager's
    run (on the H200, decode steps 21-22% slower beside saves of other requests by the server
    path with its defaults, 0.3-1.9% by the engine path; docs/performance.md).

    The engine path gathers a batch of chunks at a time into a GPU staging buffer of
    `staging_bytes` (default 64 MiB, at least one chunk; allocated at its first copy) and
    copies each run of adjacent arena slots in one piece.

    Outcomes per key as `Client.save`/`load` give them, with a save's `done` named `stored`.
    Errors of the Manager's session (`Unavailable`, `Disconnected`, ...) are raised. Use it from
    one thread.
    """

    staging_bytes = 64 << 20
    _PATHS = ("auto", "server", "engine")

    def __init__(self, client: Any, cache: GpuKvCache, path: str = "auto", log: Any = None,
                 save_path: Optional[str] = None) -> None:
        for what, p in (("GPU copy path", path), ("GPU save path", save_path)):
            if p is not None and p not in self._PATHS:
                raise InvalidArgument(f"{what} {p!r}: one of auto, server, engine")
        self.client = client
        self.cache = cache
        self.paths = {"load": path, "save": save_path or path}
        self._log = log
        self._reg: Any = None
        self._refused = False  # the Manager refused the registration: `auto` copies in the engine
        self._engine: Any = None
        self._staging: Any = None

    def _resolved(self, op: str) -> str:
        p = self.paths[op]
        if p == "auto":
            return "engine" if self._refused else ("server" if self._reg is not None else "auto")
        return p

    @property
    def active_path(self) -> str:
        """The path loads take now: `engine`, `server`, or `auto` before the first copy."""
        return self._resolved("load")

    @property
    def active_save_path(self) -> str:
        """The path saves take now, as `active_path`."""
        return self._resolved("save")

    def prepare(self) -> None:
        """Does now what the first copies would: registers the cache with the Manager (server
        path) and the arena mapping with CUDA (engine path: about 50 ms per GiB of arena), as
        the two directions need. Errors as a copy would raise them."""
        import torch

        with torch.cuda.device(self.cache.device):
            if any(self._resolved(op) != "engine" for op in self.paths):
                self._registration()
            if "engine" in (self._resolved("load"), self._resolved("save")):
                self._engine_copies()._arena_tensor(self.cache.device)

    def _registration(self) -> Any:
        """The Manager's registration of the cache; None once it refused it (`auto`)."""
        from .._native import OrbitKVError, Unavailable

        if self._reg is None and not self._refused:
            try:
                self._reg = self.client.register_gpu(device_uuid(self.cache.device), self.cache.layout(),
                                                     self.cache.regions())
            except Unavailable:
                raise
            except OrbitKVError as e:
                if "server" in self.paths.values() or not self.client.is_connected:
                    raise
                if self._log is not None:
                    self._log.warning("OrbitKV: the Manager did not take the GPU KV cache (%s); this process "
                                      "copies its pages itself from now on", e)
                self._refused = True
        return self._reg

    def _engine_copies(self) -> Any:
        import torch

        if self._engine is None:
            self._engine = EngineCopies(self.client, stream=torch.cuda.Stream(self.cache.device))
        return self._engine

    def _run(self, op: str, keys: Sequence[Any], blocks: Sequence[int], retried: bool = False) -> List[str]:
        import torch

        with torch.cuda.device(self.cache.device):
            reg = None
            if self._resolved(op) != "engine":
                reg = self._registration()  # None: refused, and `auto` goes to the engine path
            if reg is None:
                engine = self._engine_copies()
                if self._staging is None:
                    rows = max(1, self.staging_bytes // self.cache.chunk_bytes)
                    self._staging = torch.empty(rows, self.cache.chunk_bytes, dtype=torch.uint8,
                                                device=self.cache.device)
                copy = engine.save_cache if op == "save" else engine.load_cache
                outcomes: List[str] = copy(keys, self.cache, blocks, self._staging)
                return outcomes
            copy = self.client.save if op == "save" else self.client.load
            try:
                served: List[str] = copy(reg, keys, blocks)
                return served
            except Stale:
                if retried:
                    raise
                # The registration belonged to a session that ended (a Manager restart):
                # register with the new one (or, refused there, go to the engine path) and copy
                # once more.
                self._reg = None
                return self._run(op, keys, blocks, retried=True)

    def save(self, keys: Sequence[Any], blocks: Sequence[int]) -> List[str]:
        """Block `blocks[i]` as chunk `keys[i]`: `stored`, `already_present`, or why not."""
        return ["stored" if o == "done" else o for o in self._run("save", keys, blocks)]

    def load(self, keys: Sequence[Any], blocks: Sequence[int]) -> List[str]:
        """The longest present prefix of `keys` into `blocks`: `done`, then `not_found`."""
        return self._run("load", keys, blocks)

    def close(self) -> None:
        """Ends the registration (or the arena's CUDA registration); errors are ignored."""
        from .._native import OrbitKVError

        if self._reg is not None:
            try:
                self.client.unregister_gpu(self._reg)
            except OrbitKVError:
                pass
            self._reg = None
        if self._engine is not None:
            self._engine.close()
        self._staging = None
