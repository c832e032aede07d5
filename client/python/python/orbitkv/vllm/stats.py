"""The connector's counters, in the form vLLM aggregates and logs (`KVConnectorStats`)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Dict, Union

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

#: Counter names: lookups (scheduler), blocks hit and missed by them, blocks loaded and saved
#: (worker), their bytes and seconds, blocks that failed to load, blocks the Manager refused to
#: save (full, or over a limit), and calls that found the Manager unavailable (each made a
#: miss).
FIELDS = (
    "lookups",
    "hit_blocks",
    "miss_blocks",
    "loaded_blocks",
    "load_bytes",
    "load_seconds",
    "load_error_blocks",
    "saved_blocks",
    "save_bytes",
    "save_seconds",
    "save_refused_blocks",
    "unavailable",
)


@dataclasses.dataclass
class OrbitKVConnectorStats(KVConnectorStats):
    """Counters since the last report; `data` maps each name of `FIELDS` to a number."""

    def __post_init__(self) -> None:
        for f in FIELDS:
            self.data.setdefault(f, 0)

    def reset(self) -> None:
        self.data = {f: 0 for f in FIELDS}

    def aggregate(self, other: KVConnectorStats) -> "OrbitKVConnectorStats":
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> Dict[str, Union[int, float]]:
        out: Dict[str, Union[int, float]] = {k: self.data.get(k, 0) for k in FIELDS}
        for k in ("load_seconds", "save_seconds"):
            out[k] = round(float(out[k]), 6)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in FIELDS)

class Counters:
    """A connector side's counters: the interval vLLM takes with each report, and the totals
    since start (logged at shutdown). Counted from the copy thread and taken from the forward
    thread, so under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._interval: Dict[str, Union[int, float]] = {f: 0 for f in FIELDS}
        self._totals: Dict[str, Union[int, float]] = {f: 0 for f in FIELDS}

    def add(self, **counts: Union[int, float]) -> None:
        with self._lock:
            for k, v in counts.items():
                self._interval[k] += v
                self._totals[k] += v

    def take(self) -> OrbitKVConnectorStats:
        """The interval's counters, and zeroes in their place."""
        with self._lock:
            out, self._interval = self._interval, dict.fromkeys(FIELDS, 0)
        return OrbitKVConnectorStats(data=out)

    def totals(self) -> Dict[str, Union[int, float]]:
        """Everything counted since start."""
        with self._lock:
            return dict(self._totals)


def build(data: Any) -> OrbitKVConnectorStats:
    return OrbitKVConnectorStats(data=dict(data or {}))
