"""Runs a real vLLM engine (CPU) on a tiny Llama, with or without the OrbitKV connector, through
the steps given as JSON, and writes what each generation returned. Used by test_vllm_engine.py.

usage: engine.py SPEC.json OUT.json
SPEC: {"model_dir", "socket" (null: no connector), "policy", "prompts": {name: [[tokens]]},
       "steps": ["gen:NAME", "reset", "kill:PID", "corrupt:NAME:PROMPT:BLOCK[:GROUP]", ...],
       optional: "engine_args" (more vllm.LLM arguments), "extra" (more of OrbitKV's
       kv_connector_extra_config), "kv_transfer" (the whole KVTransferConfig, for MultiConnector),
       "groups" (`orbitkv.vllm.config.Group` arguments of each KV cache group, for corrupt),
       "max_tokens" (of each generation; default 12),
       "kv_params": {"out": PATH} (generations ask for a remote decode, P/D's prefill side, and
       write each output's kv_transfer_params to PATH) or {"in": PATH} (wait for PATH, and
       generate with its kv_transfer_params, P/D's decode side)}
       Steps "touch:PATH" and "wait:PATH" make and wait for a file (two engines in step);
       "metrics" records vLLM's counters."""

import json
import os
import signal
import sys
import time


def wait_for(path, timeout=600.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear in {timeout:g} s")
        time.sleep(0.1)


def corrupt(llm, spec, socket, name, prompt, block, group=None):
    """Replaces the chunk of one block of a prompt (of one KV cache group: `group`) by one of
    another length (as another layout would have written), so that the worker's load of it
    fails."""
    import orbitkv
    from orbitkv.vllm.config import Group, layout_name, namespace
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    cfg = llm.llm_engine.vllm_config
    hash_fn = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
    kv_cache_utils.init_none_hash(hash_fn)
    bs = cfg.cache_config.block_size
    tokens = spec["prompts"][name][prompt]
    parent = None
    for b in range(block + 1):
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[b * bs:(b + 1) * bs], None)
    if group is None:
        d = namespace(cfg, 0, layout_name(cfg))
    else:  # the group as the test describes it (vLLM's KV cache config lives in the engine core)
        d = namespace(cfg, 0, layout_name(cfg), Group(**spec["groups"][group]))
    key = orbitkv.ChunkKey(d.id, orbitkv.chunk_digest(bytes(parent)))
    c = orbitkv.Client(socket)
    c.register_namespace(d)  # a session names only namespaces it registered
    assert c.lookup([key]), "the block to corrupt was saved"
    assert c.evict([key]) == ["done"]
    assert c.put([(key, b"\x01" * 100)]) == ["stored"]


def main():
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = dict(model=spec["model_dir"], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              dtype="float32", max_model_len=2048, seed=0)
    kw.update(spec.get("engine_args") or {})
    if spec.get("kv_transfer"):
        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer"])
    elif spec.get("socket"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OrbitKVConnector",
            kv_connector_module_path="orbitkv.vllm",
            kv_role="kv_both",
            kv_load_failure_policy=spec.get("policy", "recompute"),
            kv_connector_extra_config={"socket": spec["socket"], "namespace_model": "tiny-llama-test",
                                       **(spec.get("extra") or {})},
        )
    llm = LLM(**kw)
    sp = SamplingParams(max_tokens=spec.get("max_tokens", 12), temperature=0.0, ignore_eos=True, detokenize=False)
    results = []
    for step in spec["steps"]:
        op, _, arg = step.partition(":")
        if op == "gen":
            prompts = spec["prompts"][arg]
            params = [sp] * len(prompts)
            kvp = spec.get("kv_params") or {}
            if "out" in kvp:
                params = [sp.clone() for _ in prompts]
                for p in params:
                    p.extra_args = {"kv_transfer_params": {"do_remote_decode": True}}
            elif "in" in kvp:
                wait_for(kvp["in"])  # written whole: the writer renames it into place
                remote = json.load(open(kvp["in"]))
                params = [sp.clone() for _ in prompts]
                for p, r in zip(params, remote):
                    p.extra_args = {"kv_transfer_params": r}
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            results.append({"step": step, "tokens": [list(o.outputs[0].token_ids) for o in outs],
                            "cached": [o.num_cached_tokens for o in outs]})
            if "out" in kvp:
                with open(kvp["out"] + ".tmp", "w") as f:
                    json.dump([o.kv_transfer_params for o in outs], f)
                os.rename(kvp["out"] + ".tmp", kvp["out"])
        elif op == "metrics":
            # vLLM's own counters (with stats on: engine_args disable_log_stats false).
            values = {}
            for m in llm.get_metrics():
                v = getattr(m, "value", None)
                if isinstance(v, (int, float)):
                    values[m.name] = values.get(m.name, 0) + v
            results.append({"step": step, "metrics": values})
        elif op == "touch":
            open(arg, "w").close()
        elif op == "wait":
            wait_for(arg)
        elif op == "reset":
            assert llm.reset_prefix_cache(), "the engine's prefix cache was reset"
        elif op == "stats":
            import socket as pysocket

            with pysocket.socket(pysocket.AF_UNIX) as s:
                s.connect(spec["socket"] + ".admin")
                s.sendall(b'{"cmd":"stats"}\n')
                buf = b""
                while not buf.endswith(b"\n"):
                    buf += s.recv(1 << 16)
            results.append({"step": step, "stats": json.loads(buf)})
        elif op == "kill":
            os.kill(int(arg), signal.SIGKILL)
        elif op == "corrupt":
            name, prompt, block, *group = arg.split(":")
            corrupt(llm, spec, spec["socket"], name, int(prompt), int(block), int(group[0]) if group else None)
        else:
            raise SystemExit(f"unknown step {step}")
        print("STEP done", step, flush=True)
    json.dump(results, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
