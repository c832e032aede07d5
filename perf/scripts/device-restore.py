"""Restore versus recompute through OrbitKV on a GPU, with a transformers Llama of an 8B model's
KV shape (32 layers, 8 KV heads, head dim 128, bf16; random weights).

For each prompt length: prefill (the recompute, timed), the KV written into vLLM's paged KV
cache (vLLM >= 0.32: one allocation seen per layer as [blocks, heads, tokens, K|V], default
layout LBNHC, 16-token blocks), saved through a running orbitkv-server by the Python package
(`orbitkv.gpu.GpuBlockCopies`, as the vLLM connector copies: CUDA IPC, the server's DMA
threads), the pages dropped; then the timed restore: leased lookup, load into fresh pages,
release, by the server's DMA threads and again by the engine's own copies (the path without
CUDA IPC). Same run: a contiguous pinned host-to-device copy of the same bytes (the PCIe
ceiling). Reported: recompute/restore, the limit
recompute/ceiling, and their ratio. Checked: restored pages byte-identical, and the next-token
logits of a decode step from the restored KV equal to those from the recomputed KV.

Then decode steps of the model (8K context) alone and while another process saves its pages
through the same server, in alternating windows: the slowdown of a decode step. Decode steps are
replayed from a CUDA graph by default, as vLLM runs them (`--decode eager` runs them eagerly:
then the launching CPU's speed, which moves between hosts, sets their time).

usage: device-restore.py --socket S [--tokens 8192,32768] [--reps 3] --out OUT.json
         [--saver process|thread] [--saver-path server|engine] [--decode graph|eager]
       (--tokens "" runs the decode-step measurement alone; --no-interference leaves it out)
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

import orbitkv
from orbitkv import Client, NamespaceDescriptor
from orbitkv.gpu import GpuBlockCopies, GpuKvCache

# vLLM's view arithmetic, as the package's tests build (and check) it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python", "tests"))
import kv_views  # noqa: E402

LAYERS, HEADS, DIM, BS = 32, 8, 128, 16


def model_8b_shape():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=LAYERS, num_attention_heads=32,
                      num_key_value_heads=HEADS, head_dim=DIM, vocab_size=128256, max_position_embeddings=65536,
                      rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


def layer_kv(cache, layer):
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def vllm_cache(blocks):
    """vLLM's KV cache of the model on the GPU: per layer [blocks, heads, 16, 2 x dim], LBNHC."""
    return kv_views.views(torch, "LBNHC", LAYERS, blocks, HEADS, BS, 2 * DIM, torch.bfloat16, device="cuda",
                          fill=False)


def to_pages(cache, tokens):
    """vLLM's paged KV cache from HF's per-layer [1, heads, T, dim] K and V."""
    n = tokens // BS
    pages = vllm_cache(n)
    for layer, p in enumerate(pages):
        k, v = layer_kv(cache, layer)
        p[..., :DIM] = k[0].reshape(HEADS, n, BS, DIM).transpose(0, 1)
        p[..., DIM:] = v[0].reshape(HEADS, n, BS, DIM).transpose(0, 1)
    return pages


def from_pages(pages, tokens):
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, p in enumerate(pages):
        k = p[..., :DIM].transpose(0, 1).reshape(HEADS, tokens, DIM).unsqueeze(0).contiguous()
        v = p[..., DIM:].transpose(0, 1).reshape(HEADS, tokens, DIM).unsqueeze(0).contiguous()
        cache.update(k, v, layer)
    return cache


def timed(fn):
    """Seconds `fn` takes, with the work it queues on the current stream (only that stream:
    a saver thread's copies on its own stream are not waited for)."""
    stream = torch.cuda.current_stream()
    stream.synchronize()
    t0 = time.perf_counter()
    out = fn()
    stream.synchronize()
    return time.perf_counter() - t0, out


def ceiling(nbytes):
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    times = [timed(lambda: dev.copy_(host, non_blocking=True))[0] for _ in range(5)]
    del host, dev
    return statistics.median(times)


def one_length(model, client, ns, tokens, reps, log):
    ids = torch.randint(0, 128000, (1, tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(tokens))
    with torch.inference_mode():
        model(ids[:, :512], use_cache=True, logits_to_keep=1)  # warm-up
        prefills = []
        for _ in range(reps):
            t, out = timed(lambda: model(ids, use_cache=True, logits_to_keep=1))
            prefills.append(t)
        recompute = statistics.median(prefills)
        pages = to_pages(out.past_key_values, tokens)
        n = tokens // BS
        keys = ns.keys(orbitkv.prefix_digests(ids[0].tolist(), BS))
        saver = GpuBlockCopies(client, GpuKvCache(pages), "server")
        nbytes = saver.cache.chunk_bytes * n
        saver.prepare()
        torch.cuda.synchronize()
        t_save, saved = timed(lambda: saver.save(keys, list(range(n))))
        assert set(saved) == {"stored"}, saved[:4]
        # Again under other keys: the first save of a server also starts its copy thread's
        # staging and kernels.
        other = ns.keys(orbitkv.prefix_digests(ids[0].tolist(), BS, extra=b"again"))
        t_save2, saved = timed(lambda: saver.save(other, list(range(n))))
        assert set(saved) == {"stored"}, saved[:4]
        fresh = vllm_cache(n)
        paths = {}
        for path in ("server", "engine"):
            loader = GpuBlockCopies(client, GpuKvCache(fresh), path)
            loader.prepare()
            times = []
            for _ in range(reps):
                for f in fresh:
                    f.zero_()

                def restore():
                    leases = client.lookup_leased(keys)
                    got = loader.load(keys[:len(leases)], list(range(len(leases))))
                    client.release_deferred(leases)
                    return len(leases), got

                t, (found, got) = timed(restore)
                assert found == n and set(got) == {"done"}, (found, got[:4])
                times.append(t)
            identical = all(torch.equal(a, b) for a, b in zip(pages, fresh))
            paths[path] = (statistics.median(times), times, identical)
            loader.close()
        restore_t, restores, identical = paths["server"]
        ceil = ceiling(nbytes)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        la = model(nxt, past_key_values=copy.deepcopy(out.past_key_values), use_cache=True).logits
        la2 = model(nxt, past_key_values=copy.deepcopy(out.past_key_values), use_cache=True).logits
        lb = model(nxt, past_key_values=from_pages(fresh, tokens), use_cache=True).logits
        logits_equal = bool(torch.equal(la, lb))
        logits_diff = float((la.float() - lb.float()).abs().max())
        recompute_repeatable = bool(torch.equal(la, la2))
        client.flush()
        saver.close()
    r = {
        "tokens": tokens, "kv_bytes": nbytes, "recompute_s": recompute, "prefill_runs_s": prefills,
        "save_s": t_save, "save_gbps": nbytes / t_save / 1e9,
        "save_again_s": t_save2, "save_again_gbps": nbytes / t_save2 / 1e9,
        "restore_s": restore_t, "restore_runs_s": restores, "restore_gbps": nbytes / restore_t / 1e9,
        "ceiling_s": ceil, "ceiling_gbps": nbytes / ceil / 1e9,
        "speedup": recompute / restore_t, "limit": recompute / ceil, "fraction_of_limit": ceil / restore_t,
        "pages_identical": identical, "next_token_logits_equal": logits_equal,
        "next_token_logits_max_abs_diff": logits_diff, "decode_step_repeatable": recompute_repeatable,
        "engine_restore_s": paths["engine"][0], "engine_restore_runs_s": paths["engine"][1],
        "engine_restore_gbps": nbytes / paths["engine"][0] / 1e9, "engine_speedup": recompute / paths["engine"][0],
        "engine_pages_identical": paths["engine"][2],
    }
    log(json.dumps(r))
    del pages, fresh, out
    torch.cuda.empty_cache()
    return r, ids


def saver_main(socket, run, stop, results, path="server"):
    """Another engine (a process, or a thread of this one as the connector's copy thread is):
    saves 1 GiB of its pages under new keys, again and again, while `run` is set, by `path`
    (the server's DMA threads or its own copies); puts (bytes, seconds) on `results` once
    `stop` is set."""
    import torch

    import orbitkv
    from orbitkv import Client

    n = 512
    pages = vllm_cache(n)
    for p in pages:
        p.normal_()
    torch.cuda.synchronize()
    c = Client(socket, name="restore-bench-saver", request_timeout=120)
    ns = c.register_namespace(namespace())
    copies = GpuBlockCopies(c, GpuKvCache(pages), path)
    copies.prepare()
    done, spent, seed = 0, 0.0, 1
    while not stop.is_set():
        if not run.wait(0.05):
            continue
        keys = ns.keys(orbitkv.prefix_digests([(seed * 1000003 + t) % 128000 for t in range(n * BS)], BS))
        seed += 1
        t0 = time.perf_counter()
        got = copies.save(keys, list(range(n)))
        spent += time.perf_counter() - t0
        done += sum(1 for g in got if g == "stored") * copies.cache.chunk_bytes
    copies.close()
    results.put((done, spent))


def namespace():
    return NamespaceDescriptor(model="okv-restore-llama-8b-shape", dtype="bf16", num_layers=LAYERS,
                               num_kv_heads=HEADS, head_dim=DIM, tokens_per_chunk=BS)


def captured_step(model, base_cache, tok):
    """One decode step (1 token after the prompt in `base_cache`) captured as a CUDA graph, as
    vLLM runs decode steps: replaying it launches the whole step at once, so its time is the
    GPU's, not the launching CPU's."""
    static_tok = tok.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(side):
        for _ in range(2):  # warm-up off the capture (library handles, workspaces)
            model(static_tok, past_key_values=copy.deepcopy(base_cache), use_cache=True)
    torch.cuda.current_stream().wait_stream(side)
    cache = copy.deepcopy(base_cache)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        model(static_tok, past_key_values=cache, use_cache=True)
    graph.cache = cache  # the graph's inputs stay alive with it
    return graph


def replayed(graph, steps):
    """Median GPU time of `steps` replays (CUDA events on the current stream), the first two
    left out."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events[2:])


def interference(model, socket, log, saver="process", path="server", ctx=8192, steps=40, windows=4, decode="graph"):
    """Decode steps (1 token, `ctx` of context) alone and while another engine saves its
    pages through the same server: by default another process (its CPU and GIL apart from this
    one's); `saver="thread"` saves from a thread of this process, as the vLLM connector's copy
    thread does. `path`: who copies the saver's pages (`server` or `engine`)."""
    import multiprocessing as mp
    import queue
    import threading

    ids = torch.randint(0, 128000, (1, ctx), device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    with torch.inference_mode():
        out = model(ids, use_cache=True, logits_to_keep=1)
    base_cache = out.past_key_values
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    if saver == "thread":
        run, stop, results = threading.Event(), threading.Event(), queue.Queue()
        worker = threading.Thread(target=saver_main, args=(socket, run, stop, results, path), daemon=True)
    else:
        spawn = mp.get_context("spawn")
        run, stop, results = spawn.Event(), spawn.Event(), spawn.Queue()
        worker = spawn.Process(target=saver_main, args=(socket, run, stop, results, path))
    worker.start()

    graph = None
    if decode == "graph":
        try:
            graph = captured_step(model, base_cache, tok)
        except RuntimeError as e:  # a model this transformers cannot capture: say so, run eagerly
            log(json.dumps({"graph_capture_failed": str(e)[:500]}))
            decode = "eager (graph capture failed)"

    def window():
        if graph is not None:
            return replayed(graph, steps)
        cache = copy.deepcopy(base_cache)
        t = tok
        times = []
        with torch.inference_mode():
            for _ in range(steps):
                dt, o = timed(lambda: model(t, past_key_values=cache, use_cache=True))
                t = o.logits[:, -1].argmax(-1, keepdim=True)
                times.append(dt)
        return statistics.median(times[2:])

    alone, beside = [], []
    window()  # warm-up
    time.sleep(5)  # the saver's start (CUDA context, pages, registration)
    for _ in range(windows):
        alone.append(window())
        run.set()
        time.sleep(0.2)
        beside.append(window())
        run.clear()
        time.sleep(0.2)
    alone.append(window())
    stop.set()
    done, spent = results.get(timeout=120)
    worker.join(60)
    # Each window beside the saves against the mean of the windows alone around it.
    slow = [b / ((alone[i] + alone[i + 1]) / 2) - 1 for i, b in enumerate(beside)]
    r = {"context": ctx, "saver": saver, "saver_path": path, "decode": decode, "decode_step_alone_s": alone, "decode_step_beside_saves_s": beside,
         "slowdown": slow, "slowdown_median": statistics.median(slow),
         "saves_gbps_beside_decode": done / spent / 1e9 if spent else None}
    log(json.dumps(r))
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-interference", action="store_true")
    ap.add_argument("--saver", choices=("process", "thread"), default="process")
    ap.add_argument("--saver-path", choices=("server", "engine"), default="server")
    ap.add_argument("--windows", type=int, default=4, help="decode windows beside saves (and one more alone)")
    ap.add_argument("--decode", choices=("graph", "eager"), default="graph",
                    help="decode steps replayed from a CUDA graph (GPU time, as vLLM runs them) or run eagerly "
                         "(wall time, which the host's CPU speed moves)")
    a = ap.parse_args()

    def log(s):
        print(s, flush=True)

    model = model_8b_shape()
    client = Client(a.socket, name="restore-bench", request_timeout=120)
    ns = client.register_namespace(namespace())
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "lengths": []}
    for tokens in [int(t) for t in a.tokens.split(",") if t]:
        r, _ = one_length(model, client, ns, tokens, a.reps, log)
        results["lengths"].append(r)
    if not a.no_interference:
        results["interference"] = interference(model, a.socket, log, a.saver, a.saver_path, windows=a.windows,
                                                decode=a.decode)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
