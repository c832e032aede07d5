"""SGLang's own host KV pools (`MHATokenToKVPoolHost`, `MLATokenToKVPoolHost`, SGLang 0.5.23),
built on the CPU as SGLang builds them from a device pool's buffers, for the SGLang backend's
tests and benchmark. Importing this module imports SGLang."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost


def _ptrs(ts: Any) -> Any:
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)


def host_pool(layout: str, mla: bool = False, *, layers: int, heads: int, head_dim: int, page: int,
              tokens: int, lora: int = 0, rope: int = 0, dtype: Any = torch.bfloat16, seed: int = 0) -> Any:
    """A host pool of `tokens` token slots (twice a device pool of `tokens`: SGLang's default
    ratio) in `layout`, filled at random with `seed` (zeros without)."""
    cpu = torch.device("cpu")
    common = dict(pin_memory=False, device="cpu", device_capacity_tokens=tokens, start_layer=0, end_layer=layers)
    if mla:
        bufs = tuple(torch.zeros(tokens + page, 1, lora + rope, dtype=dtype) for _ in range(layers))
        info = MLABufferInfo(buffers=bufs, data_ptrs=_ptrs(bufs), layer_indices=tuple(range(layers)),
                             device_layer_num=layers, page_size=page, kv_lora_rank=lora, qk_rope_head_dim=rope,
                             kv_cache_dim=lora + rope, dtype=dtype, device=cpu)
        pool = MLATokenToKVPoolHost(info, 2.0, 0, page, layout, target_layer_num=layers, **common)
    else:
        k = tuple(torch.zeros(tokens + page, heads, head_dim, dtype=dtype) for _ in range(layers))
        v = tuple(torch.zeros(tokens + page, heads, head_dim, dtype=dtype) for _ in range(layers))
        buffers = KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD)
        info = MHABufferInfo(buffers=buffers, page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
                             dtype=dtype, device=cpu)
        pool = MHATokenToKVPoolHost(info, 2.0, 0, page, layout, **common)
    if seed:
        g = torch.Generator().manual_seed(seed)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(dtype))
    return pool
