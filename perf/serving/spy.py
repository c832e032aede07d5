"""CPU profiles of a serving run's engine processes, with py-spy: where the engine's CPU time
goes while a workload runs (the model's forward passes, OrbitKV's connector, vLLM's scheduler
and the rest), as shares of the samples of each process.

Used by bench.py's `--profile PY_SPY`: py-spy records each engine process (`VLLM::Worker`,
`VLLM::EngineCore`) for the length of the workloads, in its collapsed-stack format; the run's
JSON gets the shares and the raw stacks stay in the run's directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Dict, List, Tuple

#: (category, a substring of a stack that puts a sample in it), first match wins.
CATEGORIES: List[Tuple[str, str]] = [
    ("orbitkv connector", "orbitkv/vllm/"),
    ("orbitkv client", "orbitkv/"),
    ("model forward", "execute_model"),
    ("scheduler", "schedule"),
]


def engine_processes(pgid: int) -> Dict[str, int]:
    """The engine's processes in process group `pgid`, by role: pid of `VLLM::Worker`,
    `VLLM::EngineCore`, and the API server (the group's leader)."""
    out = {"api-server": pgid}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")[0].decode(errors="replace")
        except (OSError, ProcessLookupError):
            continue
        if cmd.startswith("VLLM::Worker"):
            out["worker"] = int(entry)
        elif cmd.startswith("VLLM::EngineCore"):
            out["engine-core"] = int(entry)
    return out


class Recorder:
    """py-spy recording each engine process until `stop`."""

    def __init__(self, py_spy: str, pgid: int, directory: str, tag: str) -> None:
        self.files: Dict[str, str] = {}
        self.procs: List[subprocess.Popen] = []
        for role, pid in engine_processes(pgid).items():
            path = os.path.join(directory, f"{tag}-profile-{role}.txt")
            self.files[role] = path
            self.procs.append(subprocess.Popen(
                [py_spy, "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "--nonblocking",
                 "--output", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def stop(self) -> Dict[str, Dict[str, float]]:
        for p in self.procs:
            p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        return {role: shares(path) for role, path in self.files.items() if os.path.exists(path)}


def shares(path: str) -> Dict[str, float]:
    """Each category's share of the samples in a collapsed-stack file (`frames count` lines),
    and the sample count."""
    counts: Dict[str, int] = {}
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not n.isdigit():
                continue
            total += int(n)
            cat = next((c for c, needle in CATEGORIES if needle in stack), "other")
            counts[cat] = counts.get(cat, 0) + int(n)
    out: Dict[str, float] = {c: counts[c] / total for c in sorted(counts)} if total else {}
    out["samples"] = total
    return out
