"""What the connector derives from vLLM's configuration: the namespace of each TP rank and the
checks that keep keys equal across processes."""

from __future__ import annotations

import os
from typing import Any, Dict

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


def sync_loads(vllm_config: Any, ex: Dict[str, Any]) -> bool:
    """Whether loads finish inside the step that schedules them (`load_mode`): `sync` (the
    worker copies before the forward pass; no step is spent waiting for the load), `async` (the
    request waits in `WAITING_FOR_REMOTE_KVS` while other requests' steps run; a GPU cache's
    DMA overlaps them), or `auto` (the default: sync for a CPU KV cache, whose copies are
    memory copies of this process, async otherwise)."""
    mode = str(ex.get("load_mode", "auto"))
    if mode not in ("auto", "sync", "async"):
        raise ConfigError(f"kv_connector_extra_config load_mode={mode!r}: auto, sync or async")
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


def namespace(vllm_config: Any, tp_rank: int, layout: str) -> NamespaceDescriptor:
    """The namespace of one TP rank's chunks: one vLLM block of every layer per chunk.

    `layout` is vLLM's KV cache layout name; the order of its pages is hashed into the layout
    version, so chunks of different byte orders never mix.
    """
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    ex = extra(vllm_config)
    served = getattr(mc, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    model = str(ex.get("namespace_model") or served or mc.model)
    use_mla = bool(getattr(mc, "use_mla", False))
    layout_version = LAYOUT_VERSIONS["mla" if use_mla else page_order(layout)]
    return NamespaceDescriptor(
        model=model[:256],
        dtype=dtype_name(vllm_config),
        num_layers=int(mc.get_num_layers(pc)),
        num_kv_heads=1 if use_mla else int(mc.get_num_kv_heads(pc)),
        head_dim=int(mc.get_head_size()),
        tokens_per_chunk=int(cc.block_size),
        kv_tensors=1 if use_mla else 2,
        layout_version=layout_version,
        tp_rank=tp_rank,
        tp_world_size=int(pc.tensor_parallel_size),
    )
