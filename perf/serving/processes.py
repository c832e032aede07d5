"""The processes a serving run starts: the OrbitKV Manager and `vllm serve`, each with its log
in the run's directory, stopped gracefully (SIGTERM, then SIGKILL after a grace period)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket as pysocket
import subprocess
import time
import urllib.request
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))


class Manager:
    """One `orbitkv-server` on a socket of its own under `directory`."""

    def __init__(self, binary: str, directory: str, args: List[str], name: str = "manager",
                 socket_name: str = "orbitkv.sock") -> None:
        self.binary, self.dir, self.args, self.name = binary, directory, args, name
        os.makedirs(directory, exist_ok=True)
        self.socket = os.path.join(directory, socket_name)
        self.proc: Optional[subprocess.Popen] = None
        self.starts = 0

    @property
    def log_path(self) -> str:
        return os.path.join(self.dir, f"{self.name}.log")

    def start(self, timeout: float = 120.0) -> None:
        self.starts += 1
        log = open(self.log_path, "ab")
        log.write(f"--- start {self.starts}: {' '.join(self.command())}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.admin("health").get("ready"):
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"orbitkv-server exited with {self.proc.returncode}: {self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"orbitkv-server not ready in {timeout:.0f} s: {self.tail()}")
            time.sleep(0.05)

    def command(self) -> List[str]:
        return [self.binary, "--socket", self.socket, *self.args]

    def tail(self, n: int = 3000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def admin(self, cmd: str) -> Dict[str, Any]:
        """The server's answer to `{"cmd": cmd}` on its admin socket, whatever its `ok` says
        (through the package's admin client); ConnectionError while no server answers there."""
        import orbitkv

        try:
            return orbitkv.admin(cmd, socket=self.socket)
        except (orbitkv.Unavailable, orbitkv.Disconnected) as e:
            raise ConnectionError(str(e)) from e

    def shard_sum(self, field: str) -> int:
        return sum(int(s.get(field) or 0) for s in self.admin("stats")["shards"])

    def stop(self, grace: float = 30.0) -> None:
        stop(self.proc, grace)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def stop(proc: Optional[subprocess.Popen], grace: float) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def free_port() -> int:
    with pysocket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """`vllm serve` through `vllm_cli.py` (the real CLI entry point), OpenAI API on a local
    port."""

    def __init__(self, python: str, directory: str, name: str, model_dir: str, args: List[str],
                 env: Optional[Dict[str, str]] = None) -> None:
        self.python, self.dir, self.name = python, directory, name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [python, os.path.join(HERE, "vllm_cli.py"), "serve", model_dir,
                     "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.env = dict(os.environ, **(env or {}))
        self.proc: Optional[subprocess.Popen] = None

    @property
    def log_path(self) -> str:
        return os.path.join(self.dir, f"{self.name}.log")

    def start(self, timeout: float = 600.0) -> float:
        """Starts the server and waits until /health answers; the seconds it took."""
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"--- {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise EngineFailed(self.name, self.proc.returncode, self.log_text())
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise RuntimeError(f"vllm serve ({self.name}) not healthy in {timeout:.0f} s: {self.tail()}")
            time.sleep(0.5)

    def tail(self, n: int = 6000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-n:]
        except OSError:
            return ""

    def log_text(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def metrics(self) -> Dict[str, float]:
        """vLLM's Prometheus samples, summed over their labels; counters under their name
        without `_total` too (`vllm:prefix_cache_hits`, ...)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            body = r.read().decode()
        out: Dict[str, float] = {}
        for line in body.splitlines():
            if line.startswith("#"):
                continue
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$", line)
            if m and m.group(3) != "NaN":
                # Counters are exposed as `<name>_total`: kept under `<name>` too.
                for name in {m.group(1), m.group(1).removesuffix("_total")}:
                    out[name] = out.get(name, 0.0) + float(m.group(3))
        return out

    def stop(self, grace: float = 90.0) -> None:
        """SIGINT (vLLM's graceful shutdown: the connector logs its totals), then SIGKILL of the
        whole process group."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        except ProcessLookupError:
            pass
        # Workers left behind by a killed front end.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def connector_totals(self, side: str) -> Optional[Dict[str, Any]]:
        """The connector's totals the engine logged at shutdown (`scheduler` or `worker`)."""
        found = None
        for line in self.log_text().splitlines():
            if f"OrbitKV connector totals ({side})" in line:
                found = json.loads(line.split(f"({side}): ", 1)[1])
        return found


class EngineFailed(RuntimeError):
    """`vllm serve` exited before it served."""

    def __init__(self, name: str, code: int, log: str) -> None:
        super().__init__(f"vllm serve ({name}) exited with {code} before serving")
        self.code, self.log = code, log

    def reason(self) -> str:
        """The engine's own words for why it stopped: the first exception its log shows (the
        root cause; the later ones report that an engine process failed)."""
        for line in self.log.splitlines():
            m = re.search(r"(?:^|\] )([A-Za-z_.]*(?:Error|Exception): .+)$", line.strip())
            if m:
                return m.group(1)[:400]
        lines = [line.strip() for line in self.log.splitlines() if line.strip()]
        return lines[-1][:400] if lines else "no output"
