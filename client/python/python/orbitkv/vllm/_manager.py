"""The connector's session with the Manager: a lazily connecting `Client`, and the rule that
a Manager that cannot be reached makes misses, logged once per outage and counted."""

from __future__ import annotations

from typing import Any, Dict, List

from vllm.logger import init_logger

from .. import Client, Disconnected, NamespaceDescriptor, OrbitKVError, Unavailable
from .stats import Counters

log = init_logger("vllm.orbitkv")


class Manager:
    def __init__(self, ex: Dict[str, Any], name: str, stats: Counters) -> None:
        self.client = Client(
            ex.get("socket"),
            name=name,
            request_timeout=float(ex.get("request_timeout", 10.0)),
            connect=False,
        )
        self.stats = stats
        self._down = False

    def register(self, descriptors: List[NamespaceDescriptor]) -> List[int]:
        """Registers the namespaces (remembered while the Manager is away); their ids."""
        for d in descriptors:
            try:
                self.client.register_namespace(d)
            except OrbitKVError as e:
                self.failed(e, "register namespace")
        return [d.id for d in descriptors]

    def failed(self, e: OrbitKVError, what: str) -> None:
        """Counts a failed call; logs the first of an outage (and other errors each time)."""
        if isinstance(e, (Unavailable, Disconnected)):
            self.stats.add(unavailable=1)
            if not self._down:
                log.warning("OrbitKV Manager unavailable (%s: %s); serving without it until it returns", what, e)
                self._down = True
            return
        log.error("OrbitKV %s failed: %s", what, e)

    def ok(self) -> None:
        if self._down:
            log.warning("OrbitKV Manager reachable again (session %s)", self.client.session_id)
            self._down = False
