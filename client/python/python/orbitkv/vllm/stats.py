"""The connector's counters, in the form vLLM aggregates and logs (`KVConnectorStats`)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Dict, Union

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

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


#: What each counter counts, for its Prometheus help text.
HELP = {
    "lookups": "Lookups the OrbitKV connector's scheduler made.",
    "hit_blocks": "Blocks OrbitKV lookups found (reported to vLLM as hits).",
    "miss_blocks": "Blocks OrbitKV lookups did not find.",
    "loaded_blocks": "Blocks loaded from OrbitKV into the engine's KV cache.",
    "load_bytes": "Bytes loaded from OrbitKV into the engine's KV cache.",
    "load_seconds": "Seconds spent loading blocks from OrbitKV.",
    "load_error_blocks": "Blocks whose load from OrbitKV failed (vLLM's kv_load_failure_policy applied).",
    "saved_blocks": "Blocks saved to OrbitKV.",
    "save_bytes": "Bytes saved to OrbitKV.",
    "save_seconds": "Seconds spent saving blocks to OrbitKV.",
    "save_refused_blocks": "Blocks the OrbitKV Manager refused to save (full, or over a limit).",
    "unavailable": "Calls that found the OrbitKV Manager unavailable (each a miss).",
}


class OrbitKVPromMetrics(KVConnectorPromMetrics):
    """The connector's counters in vLLM's Prometheus metrics, per engine:
    `vllm:orbitkv_<counter>_total` (vLLM also needs them to log stats of the connector inside
    its MultiConnector)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: Dict[str, Any] = {}
        for f in FIELDS:
            counter = self._counter_cls(name=f"vllm:orbitkv_{f}", documentation=HELP[f], labelnames=labelnames)
            self.counters[f] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: Any, engine_idx: int = 0) -> None:
        data = getattr(transfer_stats_data, "data", transfer_stats_data) or {}
        per_engine = {f: c.get(engine_idx) for f, c in self.counters.items()}
        for f, child in per_engine.items():
            value = data.get(f, 0)
            if child is not None and value:
                child.inc(value)
