"""The `orbitkv` wheel as a user installs it. scripts/test copies this file into a temporary
directory outside the checkout and runs it with the python of a fresh venv there, into which
the wheel was installed:

- nothing of the checkout is on sys.path or PATH, and `orbitkv` is the venv's;
- `orbitkv-server`, `orbitkv-ctl` and `orbitkv-perf` are the venv's commands, and their
  `--version` is `orbitkv.__version__`;
- bad input: io_uring refused (a seccomp filter, as a container's profile may set), a memlock
  limit below the arena, and `--gpu required` without CUDA each give the server's own message
  (an exit status, or a warning while it serves), never a Python traceback;
- `orbitkv-server` started from PATH with its embedded defaults (no flags, no file): a Python
  round trip through the default socket, `orbitkv-ctl health` and `stats` against it, and a
  clean stop on SIGTERM;
- with `--vllm-engine ENGINE_PY` (tests/vllm/engine.py, copied beside this file): a real vLLM
  engine with the OrbitKV connector against that server: blocks saved, then loaded back after
  the engine's own prefix cache is reset, with the tokens of a run without OrbitKV.

usage: check_installed.py CHECKOUT [--vllm-engine ENGINE_PY]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import orbitkv

COMMANDS = ("orbitkv-server", "orbitkv-ctl", "orbitkv-perf")


def say(msg: str) -> None:
    print(f"check_installed: {msg}", flush=True)


def inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root + os.sep)


def check_isolated(checkout: str) -> None:
    """Nothing of the checkout on sys.path or PATH; the package and commands are the venv's."""
    bad = [p for p in sys.path if p and inside(p, checkout)]
    assert not bad, f"sys.path reaches into the checkout: {bad}"
    bad = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and inside(p, checkout)]
    assert not bad, f"PATH reaches into the checkout: {bad}"
    assert inside(orbitkv.__file__, sys.prefix), f"orbitkv is not the venv's: {orbitkv.__file__}"
    assert "PYTHONPATH" not in os.environ, "PYTHONPATH is set"
    for c in COMMANDS:
        found = shutil.which(c)
        assert found and inside(found, sys.prefix), f"{c} on PATH is {found}, not the venv's ({sys.prefix})"
    say(f"isolated: orbitkv {orbitkv.__version__} and {', '.join(COMMANDS)} from {sys.prefix}")


def check_versions() -> None:
    for c in COMMANDS:
        out = subprocess.run([c, "--version"], capture_output=True, text=True, check=True).stdout.split()
        assert out == [c, orbitkv.__version__], (
            f"{c} --version says {out}; orbitkv.__version__ is {orbitkv.__version__}"
        )
    say(f"versions agree: {orbitkv.__version__}")


# Classic BPF and seccomp (linux/filter.h, linux/seccomp.h), for refusing io_uring_setup.
class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]


def refuse_io_uring() -> None:
    """In the child before exec: io_uring_setup (425 on every architecture) fails with EPERM."""
    libc = ctypes.CDLL(None, use_errno=True)
    prog = (SockFilter * 4)(
        SockFilter(0x20, 0, 0, 0),  # load the system call's number
        SockFilter(0x15, 0, 1, 425),  # io_uring_setup?
        SockFilter(0x06, 0, 0, 0x0005_0000 | 1),  # SECCOMP_RET_ERRNO | EPERM
        SockFilter(0x06, 0, 0, 0x7FFF_0000),  # SECCOMP_RET_ALLOW
    )
    fprog = SockFprog(4, prog)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        os._exit(90)
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        os._exit(91)


def low_memlock() -> None:
    """In the child before exec: a memlock limit of 1 MiB, below a 64 MiB arena. Root's
    CAP_IPC_LOCK would lift the limit: it leaves the capability bounding set first."""
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(24, 14, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_IPC_LOCK
            os._exit(92)


def no_traceback(text: str) -> None:
    assert "Traceback" not in text and "panicked" not in text, text


#: Every server started, so that a failed check leaves none running.
STARTED = []


class Server:
    """`orbitkv-server` from PATH with `args`, its stderr in a file."""

    def __init__(self, args, socket: str, preexec=None) -> None:
        self.socket = socket
        self.log_path = tempfile.mktemp(prefix="orbitkv-server-", suffix=".log")
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(["orbitkv-server", *args], stdout=self.log_file, stderr=subprocess.STDOUT,
                                     preexec_fn=preexec)
        STARTED.append(self.proc)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def ctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["orbitkv-ctl", "--socket", self.socket, *args], capture_output=True, text=True)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.ctl("health").returncode != 0:
            assert self.proc.poll() is None, f"orbitkv-server exited {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"orbitkv-server not ready in {timeout} s:\n{self.log()}"
            time.sleep(0.1)

    def wait_exit(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as e:
            self.proc.kill()
            raise AssertionError(f"orbitkv-server did not exit in {timeout} s:\n{self.log()}") from e

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.wait_exit()
        assert rc == 0, f"orbitkv-server exited {rc} on SIGTERM:\n{self.log()}"
        no_traceback(self.log())


def check_bad_input(tmp: str) -> None:
    sock = os.path.join(tmp, "bad.sock")
    small = ["--socket", sock, "--dram", "64MiB", "--shards", "1"]

    s = Server(small, sock, preexec=refuse_io_uring)
    rc = s.wait_exit()
    log = s.log()
    assert rc == 2 and "io_uring is not available" in log, f"exit {rc}:\n{log}"
    no_traceback(log)
    say("io_uring refused: " + log.strip().splitlines()[-1][:160] + " ...")

    s = Server(small, sock, preexec=low_memlock)
    s.wait_ready()
    log = s.log()
    assert "could not lock the arena in memory" in log and "it stays pageable" in log, log
    # The message names the limit, the arena's size and the ways out.
    assert "RLIMIT_MEMLOCK is 1048576 bytes" in log and "--no-lock-arena" in log, log
    s.stop()
    say("memlock below the arena: served, pageable arena, said so")

    s = Server([*small, "--gpu", "required"], sock)
    deadline = time.monotonic() + 60
    while s.proc.poll() is None and s.ctl("health").returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    if s.proc.poll() is None:
        s.stop()
        say("--gpu required: this machine has a CUDA device; served")
    else:
        log = s.log()
        assert s.proc.returncode == 2 and "--gpu required" in log and "no CUDA device" in log, log
        no_traceback(log)
        say("no CUDA, --gpu required: " + log.strip().splitlines()[-1][:160])


def check_defaults_round_trip() -> Server:
    """The server with no flags at all; the client and ctl find it at the default socket."""
    sock = orbitkv.default_socket_path()
    s = Server([], sock)
    s.wait_ready()
    log = s.log()
    assert "no CUDA device: serving DRAM/SSD only" in log or "GPU save/load ready" in log, log
    c = orbitkv.Client(name="installed-wheel")
    assert c.socket == sock
    ns = c.register_namespace(orbitkv.NamespaceDescriptor(
        model="installed/check", dtype="fp32", num_layers=1, num_kv_heads=1, head_dim=256, tokens_per_chunk=16))
    keys = ns.keys(orbitkv.prefix_digests(list(range(64)), 16))
    values = [bytes([i]) * 4096 for i in range(len(keys))]
    assert c.put(list(zip(keys, values))) == ["stored"] * len(keys)
    assert [h.len for h in c.lookup(keys)] == [4096] * len(keys)
    assert [bytes(v) for v in c.get(keys)] == values
    stats = json.loads(s.ctl("stats", "--json").stdout)
    assert sum(sh["entries"] for sh in stats["shards"]) >= len(keys), stats
    say(f"defaults ({sock}): put, lookup, get of {len(keys)} chunks; orbitkv-ctl health and stats")
    return s


def check_vllm(engine_py: str, tmp: str, socket: str) -> None:
    """The connector against the server: tests/vllm/engine.py, with and without OrbitKV."""
    block = 128
    rng = random.Random(11)
    prompts = {"p": [[rng.randrange(3, 1000) for _ in range(4 * block + 40)] for _ in range(2)]}
    model = os.path.join(tmp, "model")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "vocab_size": 1000, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        }, f)

    def run(name: str, sock, steps):
        spec_path, out_path = os.path.join(tmp, f"{name}.json"), os.path.join(tmp, f"{name}.out.json")
        with open(spec_path, "w") as f:
            json.dump({"model_dir": model, "socket": sock, "prompts": prompts, "steps": steps}, f)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="60")
        p = subprocess.run([sys.executable, engine_py, spec_path, out_path], env=env, capture_output=True,
                           text=True, timeout=900, cwd=tmp)
        assert p.returncode == 0, f"vLLM engine ({name}) failed:\n{(p.stdout + p.stderr)[-6000:]}"
        with open(out_path) as f:
            return json.load(f)

    (base,) = run("baseline", None, ["gen:p"])
    first, loaded, stats = run("orbitkv", socket, ["gen:p", "reset", "gen:p", "stats"])
    assert first["tokens"] == base["tokens"] and loaded["tokens"] == base["tokens"]
    assert loaded["cached"] == [4 * block] * 2, loaded["cached"]
    assert sum(sh["hits"] for sh in stats["stats"]["shards"]) >= 2 * 4
    say("vLLM: blocks saved, loaded back after the prefix cache reset (4 of 4 per prompt), same tokens")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkout")
    ap.add_argument("--vllm-engine")
    a = ap.parse_args()
    check_isolated(a.checkout)
    check_versions()
    tmp = tempfile.mkdtemp(prefix="okv-installed-")
    try:
        check_bad_input(tmp)
        server = check_defaults_round_trip()
        if a.vllm_engine:
            check_vllm(a.vllm_engine, tmp, server.socket)
        else:
            say("vLLM: not run (no --vllm-engine)")
        server.stop()
    finally:
        for proc in STARTED:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    say("ok")


if __name__ == "__main__":
    main()
