"""The KV capacity (tokens) vLLM gives a hybrid model with its hybrid KV cache manager on (as
with OrbitKV's connector, `SupportsHMA`) and off (as with a connector without it): the Gemma
3-shaped model of test_vllm_hybrid.py at Gemma 3's window (1024 tokens), a 32768-token context,
2048-token prefill chunks and 1 GiB of CPU KV cache. Prints what vLLM logs for each.

usage: kv_capacity.py SOCKET   (a running orbitkv-server's socket)
"""

import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    sys.path.insert(0, HERE)
    from test_vllm_hybrid import gemma3_model

    tmp = tempfile.mkdtemp(prefix="okv-capacity", dir="/tmp")
    model = gemma3_model(os.path.join(tmp, "gemma3"))
    cfg = json.load(open(os.path.join(model, "config.json")))
    cfg.update(sliding_window=1024, max_position_embeddings=32768)
    json.dump(cfg, open(os.path.join(model, "config.json"), "w"))
    args = {"max_model_len": 32768, "max_num_batched_tokens": 2048}
    for name, more in (("HMA on (OrbitKV connector)", {}),
                       ("HMA off", {"disable_hybrid_kv_cache_manager": True})):
        spec = {"model_dir": model, "socket": sys.argv[1], "prompts": {}, "steps": [],
                "engine_args": {**args, **more}}
        path = os.path.join(tmp, "spec.json")
        json.dump(spec, open(path, "w"))
        out = subprocess.run([sys.executable, os.path.join(HERE, "engine.py"), path, os.path.join(tmp, "out.json")],
                             env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"), capture_output=True, text=True)
        found = re.search(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: "
                          r"([\d.]+)x", out.stdout + out.stderr)
        if out.returncode != 0 or not found:
            print(f"{name}: the engine failed\n{(out.stdout + out.stderr)[-3000:]}")
            return 1
        print(f"{name}: {found.group(1)} tokens, {found.group(3)} requests of {found.group(2)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
