"""Fixtures: a real `orbitkv-server` on a temporary socket.

The server binary is `$ORBITKV_SERVER_BIN`, else the workspace's `target/debug/orbitkv-server`
(the test command builds it first).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket as pysocket
import subprocess
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]


def server_bin() -> str:
    path = os.environ.get("ORBITKV_SERVER_BIN") or str(REPO / "target" / "debug" / "orbitkv-server")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no orbitkv-server at {path}: run `cargo build -p orbitkv-server` or set ORBITKV_SERVER_BIN")
    return path


class Server:
    """One orbitkv-server process; `restart`, `kill` and `admin` as the tests need."""

    def __init__(self, args: List[str], directory: Optional[str] = None) -> None:
        self.dir = directory or tempfile.mkdtemp(prefix="okvpy", dir="/tmp")
        self.socket = os.path.join(self.dir, "s.sock")
        self.args = args
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    def start(self) -> None:
        log = open(os.path.join(self.dir, "server.log"), "ab")
        self.proc = subprocess.Popen(
            [server_bin(), "--socket", self.socket, "--no-lock-arena", *self.args],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                if self.admin("health").get("ready"):
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in 30 s: {self.log()}")
            time.sleep(0.02)

    def log(self) -> str:
        with open(os.path.join(self.dir, "server.log"), "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def admin(self, cmd: str) -> Dict[str, Any]:
        with pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(self.socket + ".admin")
            s.sendall(json.dumps({"cmd": cmd}).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                part = s.recv(65536)
                if not part:
                    break
                buf += part
        return json.loads(buf)

    def shard_sum(self, field: str) -> int:
        return sum(s[field] for s in self.admin("stats")["shards"])

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()


def wait_until(what: str, cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server(["--shards", "2", "--dram", "32MiB"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gpu_server() -> Iterator[Server]:
    """A Manager that must use the GPU (the GPU tests; they skip before asking without one)."""
    s = Server(["--shards", "2", "--dram", "512MiB", "--gpu", "required"])
    yield s
    s.stop()
