"""Fixtures: a real `orbitkv-server` on a temporary socket.

The server binary is `$ORBITKV_SERVER_BIN`, else the workspace's `target/debug/orbitkv-server`
(the test command builds it first).
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import time
from typing import Iterator, List, Optional

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "perf" / "serving"))

from processes import Manager  # noqa: E402


def server_bin() -> str:
    path = os.environ.get("ORBITKV_SERVER_BIN") or str(REPO / "target" / "debug" / "orbitkv-server")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no orbitkv-server at {path}: run `cargo build -p orbitkv-server` or set ORBITKV_SERVER_BIN")
    return path


class Server(Manager):
    """One orbitkv-server process (perf/serving's `Manager`), started at once on `s.sock` in
    a temporary directory (or `directory`, where a client may already wait for that socket);
    `restart`, `kill` and `admin` as the tests need."""

    def __init__(self, args: List[str], directory: Optional[str] = None) -> None:
        d = directory or tempfile.mkdtemp(prefix="okvpy", dir="/tmp")
        super().__init__(server_bin(), d, ["--no-lock-arena", *args], name="server", socket_name="s.sock")
        self.start()

    def start(self, timeout: float = 30.0) -> None:
        super().start(timeout)

    def log(self) -> str:
        return self.tail(4000)

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
