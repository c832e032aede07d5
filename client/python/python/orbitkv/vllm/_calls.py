"""The scheduler's calls to the Manager, on a thread of their own.

vLLM's scheduler runs every request of the engine through one loop; a call to the Manager made
on it would stall the whole engine for as long as the Manager takes to answer (up to the
request timeout when it is stopped or overloaded). So the scheduler side hands its calls to
this thread, in order: lookups come back as futures it waits on for a short budget (asking vLLM
to try the request again next step when the answer is late, and giving the lookup up, as a
miss, past its deadline), releases go without waiting. The thread owns the session's calls:
one at a time, in the order given, as the client serializes them anyway.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Literal, Optional, overload


class Calls:
    """A single thread running the scheduler's Manager calls in order, with at most `bound`
    of them queued or running (past it, `submit` refuses: the caller treats it as a miss)."""

    def __init__(self, bound: int = 256) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="orbitkv-scheduler")
        self._bound = bound
        self._lock = threading.Lock()
        self._queued = 0

    @overload
    def submit(
        self, fn: Callable[..., Any], *args: Any, bounded: Literal[False]
    ) -> "concurrent.futures.Future[Any]": ...

    @overload
    def submit(
        self, fn: Callable[..., Any], *args: Any, bounded: bool = True
    ) -> Optional["concurrent.futures.Future[Any]"]: ...

    def submit(
        self, fn: Callable[..., Any], *args: Any, bounded: bool = True
    ) -> Optional["concurrent.futures.Future[Any]"]:
        """Runs `fn(*args)` on the thread; None when `bounded` and `bound` calls are already
        waiting (releases pass `bounded=False`: a lease must go back)."""
        with self._lock:
            if bounded and self._queued >= self._bound:
                return None
            self._queued += 1
        fut = self._pool.submit(fn, *args)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, _: Any) -> None:
        with self._lock:
            self._queued -= 1

    @property
    def queued(self) -> int:
        with self._lock:
            return self._queued

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
