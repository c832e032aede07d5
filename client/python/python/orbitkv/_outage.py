"""The rule engine integrations share: a Manager that cannot be reached makes misses, logged
once per outage (other errors each time) and counted."""

from __future__ import annotations

from typing import Any, Callable

from ._native import Disconnected, OrbitKVError, Unavailable


class Outage:
    """Tracks whether the Manager is reachable, for `log` (a `logging.Logger`); `count` is
    called once per failed call that found it unreachable."""

    def __init__(self, log: Any, count: Callable[[], None] = lambda: None) -> None:
        self.log = log
        self.count = count
        self.down = False

    def failed(self, e: OrbitKVError, what: str) -> None:
        if isinstance(e, (Unavailable, Disconnected)):
            self.count()
            if not self.down:
                self.log.warning("OrbitKV Manager unavailable (%s: %s); serving without it until it returns", what, e)
                self.down = True
            return
        self.log.error("OrbitKV %s failed: %s", what, e)

    def ok(self, session: Any = None) -> None:
        if self.down:
            self.log.warning("OrbitKV Manager reachable again (session %s)", session)
            self.down = False
