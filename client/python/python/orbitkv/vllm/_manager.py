"""The connector's session with the Manager: a lazily connecting `Client`, and the rule that
a Manager that cannot be reached makes misses, logged once per outage and counted."""

from __future__ import annotations

from typing import Any, Dict, List

from vllm.logger import init_logger

from .. import Client, NamespaceDescriptor, OrbitKVError
from .._outage import Outage
from .config import seconds
from .stats import Counters

log = init_logger("vllm.orbitkv")


class Manager:
    def __init__(self, ex: Dict[str, Any], name: str, stats: Counters) -> None:
        self.client = Client(
            ex.get("socket"),
            name=name,
            request_timeout=seconds(ex, "request_timeout", 10.0),
            connect=False,
        )
        self.stats = stats
        self._outage = Outage(log, lambda: stats.add(unavailable=1))

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
        self._outage.failed(e, what)

    def ok(self) -> None:
        self._outage.ok(self.client.session_id)
