"""The SGLang backend's page copies against a single-core memcpy measured in the same run.

A real SGLang 0.5.23 host pool (page_first, an 8B model's KV shape: 32 layers, 8 KV heads,
head dim 128, bf16; 16-token pages of 2 MiB) and `orbitkv.sglang.OrbitKVStorage` created by
SGLang's own backend factory against a running orbitkv-server. Per thread count: `batch_set_v1`
of batches of 128 pages (SGLang's storage batch) under new keys, then `batch_exists` +
`batch_get_v1` of the same pages into other pages of the pool. The baseline: numpy's copy of
one batch's bytes between two buffers (one thread), before and after each thread count; the
ratio per core is (GB/s / threads) / memcpy GB/s, with the better memcpy of the two. Beside it,
the same bytes copied by as many numpy copies at once as the backend has threads
(`memcpy_threads_gbps`): where the host's memory bus, not a core, is the limit, the per-core
ratio falls for any copier, and `*_vs_threads_memcpy` says how the backend does against that.
Also: numpy copies between a tensor and the mapped arena itself (`arena_*_gbps`), and with
--client-only the time in each client call (`lookup_ms`, `load_ms`, `release_ms`).

Without SGLang installed (or with --client-only) the same copies run through the client calls
the backend makes (`Client.save_blocks` / `lookup_leased` / `load_blocks` on the pool's K and V
tensors), on a tensor of the pool's page_first shape: for hosts whose Python SGLang's wheel
does not install on.

usage: sglang-backend-bench.py --server-bin target/release/orbitkv-server [--threads 1,2]
       [--batches 6] [--dram 6GiB] [--shards 1] [--client-only] [--no-checksums] [--out OUT.json]
"""

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch

import orbitkv  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python", "tests"))

LAYERS, HEADS, DIM, PAGE, BATCH = 32, 8, 128, 16, 128


def copy_gbps(dst, src, reps=5):
    """One thread's numpy copy of `src` into `dst` (after one untimed copy): GB/s of the median
    of `reps`."""
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return src.nbytes / statistics.median(times) / 1e9


def memcpy_gbps(nbytes):
    a = np.ones(nbytes, dtype=np.uint8)
    return copy_gbps(np.empty_like(a), a)


def memcpy_threads_gbps(nbytes, threads, reps=5):
    """`threads` numpy copies at once (numpy lets go of the GIL while it copies), each of its
    share of `nbytes`: what this host's memory gives that many cores copying; the best of
    `reps`."""
    per = nbytes // threads
    src = [np.ones(per, dtype=np.uint8) for _ in range(threads)]
    dst = [np.ones(per, dtype=np.uint8) for _ in range(threads)]
    best = 0.0
    for _ in range(reps):
        start = threading.Barrier(threads + 1)

        def copy(i):
            start.wait()
            np.copyto(dst[i], src[i])

        workers = [threading.Thread(target=copy, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        start.wait()
        t0 = time.perf_counter()
        for w in workers:
            w.join()
        best = max(best, per * threads / (time.perf_counter() - t0) / 1e9)
    return best


def keys(batch, n):
    return [hashlib.sha256(f"bench-{batch}-{i}".encode()).hexdigest() for i in range(n)]


def indices(pages):
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def arena_copy_gbps(client, nbytes, reps=5):
    """numpy copies between a torch CPU tensor (as the host pool is) and the top of the
    Manager's mapped arena: the memory the backend copies to and from, without the backend.
    Run while no page is stored (each thread count's pages are evicted after it), so nothing
    live is there."""
    whole = np.frombuffer(client.host_arena(), dtype=np.uint8)
    top = len(whole) - nbytes - (2 << 20)
    arena = whole[top:top + nbytes]
    pool = torch.ones(nbytes, dtype=torch.uint8).numpy()
    return {"to_arena": copy_gbps(arena, pool, reps), "from_arena": copy_gbps(pool, arena, reps)}


def sglang_backend(sock, threads, pool_tokens, checksums):
    """SGLang's factory, host pool and OrbitKVStorage."""
    import sglang_pools
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    pool = sglang_pools.host_pool("page_first", layers=LAYERS, heads=HEADS, head_dim=DIM, page=PAGE,
                                  tokens=pool_tokens, seed=1)
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="bench-8b-shape",
        extra_config={"backend_name": "orbitkv", "module_path": "orbitkv.sglang", "class_name": "OrbitKVStorage",
                      "interface_v1": 1, "socket": sock, "copy_threads": threads,
                      "client_checksums": checksums})
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    return b, pool.kv_buffer


class ClientCopies:
    """The backend's copies without SGLang: the client calls OrbitKVStorage makes, on a
    page_first pool tensor [2, tokens, layers, heads, dim]."""

    def __init__(self, sock, threads, pool_tokens, checksums):
        self.kv_buffer = torch.randn(2, pool_tokens, LAYERS, HEADS, DIM).to(torch.bfloat16)
        pages = pool_tokens // PAGE
        self.regions = [orbitkv.Region(self.kv_buffer[kv], block_bytes=self.kv_buffer[kv].nbytes // pages)
                        for kv in range(2)]
        self.chunk_bytes = sum(r.block_bytes for r in self.regions)
        self.client = orbitkv.Client(sock, copy_threads=threads, client_checksums=checksums)
        self.ns_id = self.client.register_namespace(orbitkv.NamespaceDescriptor(
            model="bench-8b-shape", dtype="bf16", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
            tokens_per_chunk=PAGE, layout_version=202)).id
        self.held = []
        self.parts = {"lookup": [], "load": [], "release": []}

    def _keys(self, keys):
        return [orbitkv.ChunkKey(self.ns_id, orbitkv.chunk_digest(bytes.fromhex(k))) for k in keys]

    def _pages(self, host_indices):
        return [i // PAGE for i in host_indices.tolist()[::PAGE]]

    def batch_set_v1(self, keys, host_indices):
        out = self.client.save_blocks(self.regions, self._keys(keys), self._pages(host_indices))
        return [o in ("stored", "already_present") for o in out]

    def batch_exists(self, keys):
        t0 = time.perf_counter()
        self.held = self.client.lookup_leased(self._keys(keys))
        self.parts["lookup"].append(time.perf_counter() - t0)
        return len(self.held)

    def batch_get_v1(self, keys, host_indices):
        ks, pages = self._keys(keys), self._pages(host_indices)
        t0 = time.perf_counter()
        out = self.client.load_blocks(self.regions, ks, pages)
        t1 = time.perf_counter()
        self.client.release_deferred(self.held)
        self.parts["load"].append(t1 - t0)
        self.parts["release"].append(time.perf_counter() - t1)
        return [o == "done" for o in out]

    def close(self):
        self.client.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server-bin", required=True)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--dram", default="6GiB")
    ap.add_argument("--shards", default="1")
    ap.add_argument("--client-only", action="store_true")
    ap.add_argument("--no-checksums", action="store_true",
                    help="client_checksums off: the Manager's shards hash each chunk at commit")
    ap.add_argument("--out")
    a = ap.parse_args()

    d = tempfile.mkdtemp(prefix="okvsglb", dir="/tmp")
    sock = os.path.join(d, "s.sock")
    server = subprocess.Popen([a.server_bin, "--socket", sock, "--no-lock-arena", "--shards", a.shards,
                               "--dram", a.dram, "--gpu", "off"], stderr=open(os.path.join(d, "server.log"), "wb"))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                orbitkv.Client(sock).ping()
                break
            except orbitkv.OrbitKVError:
                assert time.monotonic() < deadline and server.poll() is None, "server did not start"
                time.sleep(0.1)
        try:
            import sglang.srt.mem_cache.hicache_storage  # noqa: F401  (not the tests' own sglang/)
            use_sglang = not a.client_only
        except ImportError:
            use_sglang = False
        results = {"path": "sglang backend" if use_sglang else "client calls", "page_bytes": None,
                   "batch_pages": BATCH, "runs": []}
        for threads in [int(t) for t in a.threads.split(",")]:
            # Room for two batches of pages, written and read back.
            if use_sglang:
                b, kv_buffer = sglang_backend(sock, threads, 2 * BATCH * PAGE, not a.no_checksums)
            else:
                b = ClientCopies(sock, threads, 2 * BATCH * PAGE, not a.no_checksums)
                kv_buffer = b.kv_buffer
            chunk = b.chunk_bytes
            nbytes = chunk * BATCH
            results["page_bytes"] = chunk
            before = memcpy_gbps(nbytes)
            arena = arena_copy_gbps(b.client, nbytes)
            together = memcpy_threads_gbps(nbytes, threads)
            sets, gets = [], []
            for i in range(a.batches):
                ks = keys(f"{threads}-{i}", BATCH)
                t0 = time.perf_counter()
                ok = b.batch_set_v1(ks, indices(range(BATCH)))
                sets.append(time.perf_counter() - t0)
                assert all(ok), ok.count(False)
                t0 = time.perf_counter()
                found = b.batch_exists(ks)
                got = b.batch_get_v1(ks, indices(range(BATCH, 2 * BATCH)))
                gets.append(time.perf_counter() - t0)
                assert found == BATCH and all(got), (found, got.count(False))
            assert torch.equal(kv_buffer[:, :BATCH * PAGE], kv_buffer[:, BATCH * PAGE:2 * BATCH * PAGE])
            after = memcpy_gbps(nbytes)
            base = max(before, after)
            set_gbps = nbytes / statistics.median(sets) / 1e9
            get_gbps = nbytes / statistics.median(gets) / 1e9
            r = {"threads": threads, "memcpy_gbps_before": before, "memcpy_gbps_after": after,
                 "set_gbps": set_gbps, "get_gbps": get_gbps,
                 "set_per_core_ratio": set_gbps / threads / base, "get_per_core_ratio": get_gbps / threads / base,
                 "memcpy_threads_gbps": together, "set_vs_threads_memcpy": set_gbps / together,
                 "get_vs_threads_memcpy": get_gbps / together,
                 "arena_to_gbps": arena["to_arena"], "arena_from_gbps": arena["from_arena"],
                 "checksums": not a.no_checksums, "set_runs_s": sets, "get_runs_s": gets}
            for part, times in getattr(b, "parts", {}).items():
                r[f"{part}_ms"] = statistics.median(times) * 1e3
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                              if not k.endswith("runs_s")}), flush=True)
            results["runs"].append(r)
            # The next run's keys are new; free the Manager's DRAM of this run's pages (through
            # the session that registered their namespace: only it may name the namespace).
            for i in range(a.batches):
                b.client.evict([orbitkv.ChunkKey(b.ns_id, orbitkv.chunk_digest(bytes.fromhex(k)))
                                for k in keys(f"{threads}-{i}", BATCH)])
            b.close()
        if a.out:
            with open(a.out, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        server.terminate()
        server.wait(20)


if __name__ == "__main__":
    main()
