"""A Manager that is still starting (populating its arena) tells clients to wait: a connecting
client waits for it, a lazy one (an engine's) raises `Unavailable` (kind `starting`) until it
serves; nothing is refused."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time

import orbitkv
import pytest
from conftest import server_bin
from processes import Manager, stop


def test_a_starting_manager_is_waited_for() -> None:
    d = tempfile.mkdtemp(prefix="okvpy", dir="/tmp")
    m = Manager(server_bin(), d, ["--no-lock-arena", "--shards", "2", "--dram", "1GiB",
                                  "--hugepages", "off"], name="server", socket_name="s.sock")
    # Each 256 MiB step of populating is held 700 ms (a failpoint of the test build).
    env = dict(os.environ, FAILPOINTS="arena-populate-step=sleep(700)")
    with open(m.log_path, "ab") as log:
        m.proc = subprocess.Popen(m.command(), stdout=subprocess.DEVNULL, stderr=log, env=env)
    try:
        deadline = time.monotonic() + 20
        health = None
        while health is None:
            try:
                health = m.admin("health")
            except OSError:
                assert time.monotonic() < deadline, m.tail()
                time.sleep(0.005)
        if health.get("ready"):
            pytest.skip("the server binary has no failpoints (build with --features failpoints)")
        assert health["state"] == "starting", health
        assert health["reason"].startswith("populating the arena: "), health
        # An engine's client: not refused, told to come back.
        lazy = orbitkv.Client(m.socket, connect=False)
        with pytest.raises(orbitkv.Unavailable) as e:
            lazy.ping()
        assert e.value.kind == "starting" and "populating the arena" in str(e.value), e.value
        # No wait asked for: the same answer at once.
        with pytest.raises(orbitkv.Unavailable) as e:
            orbitkv.Client(m.socket, start_wait=0.0)
        assert e.value.kind == "starting", e.value
        # A connecting client waits until the Manager serves.
        c = orbitkv.Client(m.socket)
        c.ping()
        assert m.admin("health")["ready"] is True
        assert m.admin("stats")["startup"]["told_to_wait"] >= 2
        # The lazy client connects at a call once its wait is over.
        deadline = time.monotonic() + 10
        while True:
            try:
                lazy.ping()
                break
            except orbitkv.Unavailable:
                assert time.monotonic() < deadline, m.tail()
                time.sleep(0.05)
        # A negative wait is refused by name.
        with pytest.raises(orbitkv.InvalidArgument, match="start_wait"):
            orbitkv.Client(m.socket, start_wait=-1.0)
    finally:
        stop(m.proc, 10)
