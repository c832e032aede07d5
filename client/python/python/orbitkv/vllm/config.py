"""What the connector derives from vLLM's configuration: the namespace of each TP rank and the
checks that keep keys equal across processes."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import NamespaceDescriptor
from .._dtypes import okv_dtype

#: Hash algorithms whose block hashes are the same in every process (vLLM's sha256 family; the
#: xxhash ones are only with PYTHONHASHSEED set, else their seed is random per process).
_STABLE_HASHES = ("sha256", "sha256_cbor")


#: The layout version of each order of a block's page (the bytes of one block in one layer):
#: heads outside tokens (vLLM's LBHNC and BLHNC layouts), tokens outside heads (LBNHC, BLNHC),
#: MLA's latent rows. A chunk is its layers' pages in turn whether the engine keeps a block's
#: layers apart (LB..) or together (BL..): both give the same chunk bytes.
LAYOUT_VERSIONS = {"HNC": 101, "NHC": 102, "mla": 107}


def page_order(layout: str) -> str:
    """The page order (a LAYOUT_VERSIONS key) of a vLLM KV cache layout name."""
    if len(layout) != 5 or set(layout[:2]) != {"L", "B"} or layout[2:] not in ("HNC", "NHC"):
        raise ConfigError(
            f"KV cache layout {layout!r} does not keep a block's page in one piece: OrbitKV stores "
            "LBNHC, LBHNC, BLNHC and BLHNC (set VLLM_KV_CACHE_LAYOUT to one of them)"
        )
    return layout[2:]


def layout_name(vllm_config: Any) -> str:
    """The KV cache layout vLLM resolved (CPU attention has one: LBHNC)."""
    layout = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if layout:
        return str(layout)
    if str(getattr(vllm_config.device_config, "device_type", "")) == "cpu":
        return "LBHNC"
    from vllm.platforms import current_platform

    if current_platform.device_type == "cpu":
        return "LBHNC"
    return "LBNHC"  # vLLM's default for CUDA attention backends without a preference


class ConfigError(ValueError):
    """A vLLM setting OrbitKV cannot work with; the message names it."""


def extra(vllm_config: Any) -> Dict[str, Any]:
    kv = vllm_config.kv_transfer_config
    return dict(getattr(kv, "kv_connector_extra_config", None) or {})


def seconds(ex: Dict[str, Any], key: str, default: float, *, zero_ok: bool = False) -> float:
    """A duration option of `kv_connector_extra_config`, in seconds; refused, naming the key,
    when it is not a number, negative, or zero where zero makes no sense."""
    value = ex.get(key, default)
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kv_connector_extra_config {key}={value!r}: seconds, a number") from None
    if not out >= 0 or (out == 0 and not zero_ok) or out == float("inf"):
        least = "0 or more" if zero_ok else "more than 0"
        raise ConfigError(f"kv_connector_extra_config {key}={value!r}: seconds, {least}")
    return out


def sync_loads(vllm_config: Any, ex: Dict[str, Any], gs: Sequence["Group"] = ()) -> bool:
    """Whether loads finish inside the step that schedules them (`load_mode`): `sync` (the
    worker copies before the forward pass; no step is spent waiting for the load), `async` (the
    request waits in `WAITING_FOR_REMOTE_KVS` while other requests' steps run; a GPU cache's
    DMA overlaps them), or `auto` (the default: sync for a CPU KV cache, whose copies are
    memory copies of this process, async otherwise).

    With several KV cache groups (`gs`) loads are async: vLLM takes a failed load of such a
    model only per request, for a request that waits for its load (block ids are per group)."""
    mode = str(ex.get("load_mode", "auto"))
    if mode not in ("auto", "sync", "async"):
        raise ConfigError(f"kv_connector_extra_config load_mode={mode!r}: auto, sync or async")
    if len(gs) > 1:
        if mode == "sync":
            raise ConfigError(
                f"kv_connector_extra_config load_mode='sync' with {len(gs)} KV cache groups: vLLM takes "
                "a failed load of a model with several KV cache groups only for a request waiting for "
                "its load; use load_mode async (or auto)"
            )
        return False
    if mode != "auto":
        return mode == "sync"
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    return str(device) == "cpu"


def check_hashing(vllm_config: Any) -> str:
    """The block-hash algorithm, refused when it is not stable across processes."""
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    if algo not in _STABLE_HASHES and not os.environ.get("PYTHONHASHSEED"):
        raise ConfigError(
            f"prefix_caching_hash_algo={algo!r} seeds its block hashes randomly per process, so "
            "OrbitKV could never find a block saved by another process: use sha256 or "
            "sha256_cbor, or set PYTHONHASHSEED for every vLLM process"
        )
    return algo


def dtype_name(vllm_config: Any) -> str:
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype == "auto":
        cache_dtype = str(vllm_config.model_config.dtype)
    try:
        return okv_dtype(cache_dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None


#: vLLM's KV cache specs OrbitKV restores, by class name: paged attention KV whose blocks a
#: request still attends to are known from its length (`Group.first_needed`).
_KINDS = {
    "FullAttentionSpec": "full",
    "MLAAttentionSpec": "full",
    "SlidingWindowSpec": "sliding_window",
    "ChunkedLocalAttentionSpec": "chunked_local",
}

#: Why the other kinds of vLLM's KV cache groups are refused (the class name otherwise).
_REFUSED = {
    "MambaSpec": "Mamba / linear-attention recurrent state",
    "RSWASpec": "reference sliding-window attention (a gap in the middle of the KV)",
    "CircularBufferSpec": "circular-buffer attention KV",
    "SlidingWindowMLASpec": "sliding-window MLA KV",
    "SinkFullAttentionSpec": "attention-sink KV",
    "CrossAttentionSpec": "cross-attention (encoder) KV",
    "EncoderOnlyAttentionSpec": "encoder-only attention",
    "HiddenStateCacheSpec": "cached hidden states",
    "HiSparseHotSpec": "HiSparse hot KV",
    "HiSparseResidentSpec": "HiSparse resident KV",
}


@dataclasses.dataclass(frozen=True)
class Group:
    """One of vLLM's KV cache groups: layers whose blocks share one block table.

    `kind` is `full`, `sliding_window` (`window` tokens, `extra` retained behind it) or
    `chunked_local` (`window`: the attention chunk). A chunk of this group holds one block of
    each of its layers."""

    index: int
    kind: str
    layer_names: Tuple[str, ...]
    block_size: int
    num_kv_heads: int
    head_dim: int
    window: int = 0
    extra: int = 0

    @property
    def tag(self) -> str:
        """The group in the namespace's model name: index, kind and window (a change of the
        window is another namespace)."""
        detail = {"full": "full", "sliding_window": f"swa{self.window}+{self.extra}",
                  "chunked_local": f"chunk{self.window}"}[self.kind]
        return f"g{self.index}.{detail}"

    def first_needed(self, n_blocks: int) -> int:
        """The first block a request of `n_blocks` computed blocks still attends to (vLLM
        frees the ones before it, as its `get_num_skipped_tokens`)."""
        computed = n_blocks * self.block_size
        if self.kind == "sliding_window":
            skipped = max(0, computed - self.window + 1 - self.extra)
        elif self.kind == "chunked_local":
            skipped = computed // self.window * self.window
        else:
            skipped = 0
        return min(n_blocks, skipped // self.block_size)


def model_type(vllm_config: Any) -> str:
    hf = getattr(vllm_config.model_config, "hf_config", None)
    return str(getattr(hf, "model_type", None) or getattr(vllm_config.model_config, "model", "?"))


def groups(vllm_config: Any, kv_cache_config: Any) -> List[Group]:
    """vLLM's KV cache groups as OrbitKV restores them; `ConfigError` naming the model type,
    the layer kind and how to serve the model without OrbitKV for any group it cannot restore
    exactly (a hit must restore every layer's state, or it gives wrong tokens).

    Without a KV cache config (vLLM < 0.32 never passes one): one full-attention group of every
    layer, as vLLM's own single-group layout."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    block_size = int(cc.block_size)
    specs = getattr(kv_cache_config, "kv_cache_groups", None)
    if not specs:
        return [Group(0, "full", (), block_size, int(mc.get_num_kv_heads(pc)), int(mc.get_head_size()))]
    out = []
    for i, g in enumerate(specs):
        spec = g.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one kind of layer
        if isinstance(inner, dict) and inner:
            spec = next(iter(inner.values()))
        cls = type(spec).__name__
        kind = _KINDS.get(cls)
        layers = ", ".join(list(g.layer_names)[:3]) + (", ..." if len(g.layer_names) > 3 else "")
        if kind is None:
            what = _REFUSED.get(cls, "a KV cache kind OrbitKV does not know")
            raise ConfigError(
                f"model type {model_type(vllm_config)!r}: KV cache group {i} ({layers}) holds {cls} "
                f"({what}), which OrbitKV does not store; a hit restoring the other layers without it "
                "would give wrong tokens. Serve this model without OrbitKV (leave out "
                "--kv-transfer-config)"
            )
        if int(spec.block_size) != block_size:
            raise ConfigError(
                f"model type {model_type(vllm_config)!r}: KV cache group {i} ({layers}) has "
                f"{spec.block_size}-token blocks, but vLLM's block hashes cover {block_size} tokens; "
                "OrbitKV keys a chunk by one block hash. Serve this model without OrbitKV (leave out "
                "--kv-transfer-config)"
            )
        window, extra = 0, 0
        if kind == "sliding_window":
            window, extra = int(spec.sliding_window), int(getattr(spec, "extra_retained_tokens", 0) or 0)
        elif kind == "chunked_local":
            window = int(spec.attention_chunk_size)
        out.append(Group(i, kind, tuple(g.layer_names), block_size, int(spec.num_kv_heads),
                         int(spec.head_size), window, extra))
    return out


def plain(gs: Sequence[Group]) -> bool:
    """One full-attention group of every layer: the layout whose namespace has no group in it
    (the keys of a model served with and without vLLM's hybrid KV cache manager stay apart)."""
    return len(gs) == 1 and gs[0].kind == "full"


def namespace(vllm_config: Any, tp_rank: int, layout: str, group: Optional[Group] = None) -> NamespaceDescriptor:
    """The namespace of one TP rank's chunks: one vLLM block of every layer per chunk.

    `layout` is vLLM's KV cache layout name; the order of its pages is hashed into the layout
    version, so chunks of different byte orders never mix. With a KV cache `group` (a model of
    several groups): that group's layers only, its tag in the model name (groups never collide).
    """
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    ex = extra(vllm_config)
    served = getattr(mc, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    model = str(ex.get("namespace_model") or served or mc.model)
    use_mla = bool(getattr(mc, "use_mla", False))
    layout_version = LAYOUT_VERSIONS["mla" if use_mla else page_order(layout)]
    num_layers, heads, head_dim = int(mc.get_num_layers(pc)), int(mc.get_num_kv_heads(pc)), int(mc.get_head_size())
    if group is not None:
        model = f"{model[:240]}#{group.tag}"
        num_layers, heads, head_dim = len(group.layer_names), group.num_kv_heads, group.head_dim
    return NamespaceDescriptor(
        model=model[:256],
        dtype=dtype_name(vllm_config),
        num_layers=num_layers,
        num_kv_heads=1 if use_mla else heads,
        head_dim=head_dim,
        tokens_per_chunk=int(cc.block_size),
        kv_tensors=1 if use_mla else 2,
        layout_version=layout_version,
        tp_rank=tp_rank,
        tp_world_size=int(pc.tensor_parallel_size),
    )


def namespaces(vllm_config: Any, tp_rank: int, layout: str, gs: Sequence[Group]) -> List[NamespaceDescriptor]:
    """One TP rank's namespace of each group (the single plain one for a one-group model)."""
    if plain(gs):
        return [namespace(vllm_config, tp_rank, layout)]
    return [namespace(vllm_config, tp_rank, layout, g) for g in gs]


#: `kv_connector_extra_config` `role`: `both` looks up, loads and saves; `prefill` the same (the
#: prefill instance of a P/D pair); `decode` saves only (never looks up, never loads: its KV
#: comes from the prefill instance through the P/D connector).
ROLES = ("both", "prefill", "decode")


def role(ex: Dict[str, Any]) -> str:
    value = ex.get("role", "both")
    if value not in ROLES:
        raise ConfigError(f"kv_connector_extra_config role={value!r}: one of {', '.join(ROLES)}")
    return str(value)
