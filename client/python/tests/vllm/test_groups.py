"""The connector's view of vLLM's KV cache groups, built with vLLM's own spec classes: which
blocks of a sliding window or a local-attention chunk a request still attends to (as vLLM's
managers free them), one namespace per group that never collides, and the refusals of what
OrbitKV cannot restore exactly, each naming the model type, the layer kind and the way out."""

from __future__ import annotations

import os
import types

import pytest

pytest.importorskip("vllm") if not os.environ.get("ORBITKV_REQUIRE_VLLM") else __import__("vllm")
torch = pytest.importorskip("torch")

from orbitkv.vllm.config import ConfigError, groups, namespace, namespaces, role, sync_loads  # noqa: E402
from test_connector_sequences import vllm_config  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

BS = 32  # test_connector_sequences' block size


def kv_config(*specs) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"layers.{i}.attn"], s) for i, s in enumerate(specs)])


def full(bs=BS):
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=16, dtype=torch.float32)


def swa(window, bs=BS):
    return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=16, dtype=torch.float32, sliding_window=window)


def cfg_with_model_type(t="gemma3_text"):
    cfg = vllm_config()
    cfg.model_config.hf_config = types.SimpleNamespace(model_type=t)
    return cfg


def test_windows_need_the_blocks_vllm_keeps():
    cfg = cfg_with_model_type()
    local = ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float32,
                                      attention_chunk_size=2 * BS)
    f, w, c = groups(cfg, kv_config(full(), swa(2 * BS), local))
    assert (f.kind, w.kind, c.kind) == ("full", "sliding_window", "chunked_local")
    assert [f.first_needed(n) for n in range(6)] == [0] * 6
    # The next token after n blocks attends to the last 64 tokens: n*32 - 64 + 1 onwards.
    assert [w.first_needed(n) for n in range(6)] == [0, 0, 0, 1, 2, 3]
    # Local attention in 64-token chunks: only the current chunk's blocks.
    assert [c.first_needed(n) for n in range(6)] == [0, 0, 2, 2, 4, 4]


def test_each_group_has_a_namespace_of_its_own():
    cfg = cfg_with_model_type()
    gs = groups(cfg, kv_config(swa(2 * BS), swa(2 * BS), full()))
    descs = namespaces(cfg, 0, "LBHNC", gs)
    assert len({d.id for d in descs}) == 3, "groups never collide, the same shapes included"
    assert [d.num_layers for d in descs] == [1, 1, 1]
    assert descs[0].model == "tiny#g0.swa64+0" and descs[2].model == "tiny#g2.full"
    # Another window is another namespace.
    other = namespaces(cfg, 0, "LBHNC", groups(cfg, kv_config(swa(4 * BS), swa(2 * BS), full())))
    assert other[0].id != descs[0].id and other[1].id == descs[1].id
    # One full-attention group (a plain model, or HMA off): the namespace of every layer as ever.
    (plain,) = namespaces(cfg, 0, "LBHNC", groups(cfg, kv_config(full())))
    assert plain.id == namespace(cfg, 0, "LBHNC").id and plain.num_layers == 2


def test_what_cannot_be_restored_is_refused_naming_it():
    cfg = cfg_with_model_type("qwen3_next")
    mamba = MambaSpec(block_size=BS, shapes=((4, 4),), dtypes=(torch.float32,))
    with pytest.raises(ConfigError) as e:
        groups(cfg, kv_config(mamba, full()))
    msg = str(e.value)
    for part in ("model type 'qwen3_next'", "group 0 (layers.0.attn)", "MambaSpec",
                 "Mamba / linear-attention recurrent state", "leave out --kv-transfer-config"):
        assert part in msg, (part, msg)
    # A group whose blocks are not the block hashes' size.
    with pytest.raises(ConfigError, match=r"group 1 \(layers.1.attn\) has 64-token blocks, but vLLM's block hashes"):
        groups(cfg, kv_config(full(), swa(128, bs=64)))
    # A failed load of a several-group model is taken per request, for async loads only.
    gs = groups(cfg_with_model_type(), kv_config(swa(64), full()))
    with pytest.raises(ConfigError, match="load_mode='sync' with 2 KV cache groups"):
        sync_loads(cfg, {"load_mode": "sync"}, gs)
    assert sync_loads(cfg, {}, gs) is False and sync_loads(cfg, {}, gs[:1]) is True


def test_pd_roles():
    assert [role({}), role({"role": "prefill"}), role({"role": "decode"})] == ["both", "prefill", "decode"]
    with pytest.raises(ConfigError, match="kv_connector_extra_config role='decoder': one of both, prefill, decode"):
        role({"role": "decoder"})


@pytest.mark.parametrize("spec,what", [
    (lambda: RSWASpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float32, rswa_window=64),
     "reference sliding-window attention"),
    (lambda: CrossAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float32),
     "cross-attention"),
    (lambda: SinkFullAttentionSpec(block_size=BS, sink_len=4, num_kv_heads=1, head_size=16, dtype=torch.float32),
     "attention-sink KV"),
])
def test_every_kind_orbitkv_cannot_restore_is_refused_by_name(spec, what):
    s = spec()
    with pytest.raises(ConfigError) as e:
        groups(cfg_with_model_type("some_model"), kv_config(full(), s))
    msg = str(e.value)
    assert f"holds {type(s).__name__} ({what}" in msg and "model type 'some_model'" in msg, msg
    assert "leave out --kv-transfer-config" in msg
