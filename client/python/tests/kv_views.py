"""vLLM (>= 0.32) KV cache views, built as vLLM builds them: one flat byte allocation seen
per layer as a `[blocks, heads, tokens, content]` view whose strides follow the layout's
permutation of `[L, B, H, N, C]`. The vLLM tests check these against vLLM's own
`create_kv_cache_views`; the GPU tests (no vLLM there) use them to build an engine's cache.
"""

from __future__ import annotations

from typing import Any, List, Tuple

#: vLLM's KVCacheLayout permutations: logical dims [L, B, H, N, C] in memory order.
PERMUTATIONS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def byte_strides(layout: str, shape: Tuple[int, int, int, int, int]) -> List[int]:
    """Byte strides of the logical dims [L, B, H, N, C] (C in bytes) for a dense layout."""
    strides = [0] * 5
    step = 1
    for dim in reversed(PERMUTATIONS[layout]):
        strides[dim] = step
        step *= shape[dim]
    return strides


def views(torch: Any, layout: str, layers: int, blocks: int, heads: int, tokens: int, content: int,
          dtype: Any, device: str = "cpu", fill: bool = True) -> List[Any]:
    """Per-layer views `[blocks, heads, tokens, content]` (content in elements of `dtype`) over
    one allocation. With `fill`, element (l, b, h, n, c) holds a value of those indices alone,
    so two layouts filled alike hold the same logical cache."""
    esize = torch.empty(0, dtype=dtype).element_size()
    shape = (layers, blocks, heads, tokens, content * esize)
    raw = torch.zeros(layers * blocks * heads * tokens * content * esize, dtype=torch.uint8, device=device)
    strides = byte_strides(layout, shape)
    v5 = torch.as_strided(raw, shape, strides)
    out = [v5[layer].view(dtype) for layer in range(layers)]
    if fill:
        idx = torch.arange(layers * blocks * heads * tokens * content, device=device)
        logical = ((idx * 2654435761) % 65521).to(torch.float32).reshape(layers, blocks, heads, tokens, content)
        for layer, v in enumerate(out):
            v.copy_(logical[layer].to(dtype))
    return out


def reference_chunk(torch: Any, cache: List[Any], block: int, order: str) -> bytes:
    """Block `block`'s chunk by definition: each layer's page in `order` (HNC or NHC)."""
    parts = []
    for v in cache:
        page = v[block]  # [H, N, C]
        if order == "NHC":
            page = page.transpose(0, 1)
        parts.append(page.contiguous().view(torch.uint8).reshape(-1))
    return bytes(torch.cat(parts).cpu().numpy().tobytes())
