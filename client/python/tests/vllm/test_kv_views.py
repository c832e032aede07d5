"""`orbitkv.gpu.GpuKvCache` against the KV cache views vLLM itself builds (its
`create_kv_cache_views`, every `KVCacheLayout`, attention and MLA), on the CPU: which layouts
it takes, the server layout it derives, and that every accepted layout gives a block's chunk
as its layers' pages in turn (LB.. and BL.. layouts the same bytes)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

import kv_views  # noqa: E402
import orbitkv  # noqa: E402
from orbitkv.gpu import GpuKvCache  # noqa: E402
from orbitkv.vllm.config import ConfigError, page_order  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

L, B, BS, HEADS, DIM, LATENT = 3, 6, 4, 2, 8, 12


def vllm_views(layout: KVCacheLayout, mla: bool):
    if mla:
        spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=LATENT, dtype=torch.bfloat16)
    else:
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16)
    strides = compute_layout_strides(spec, B, L, layout)
    tensor = KVCacheTensor(size=L * B * spec.page_size_bytes, layers=[f"layer.{i}" for i in range(L)],
                           layer_stride=strides[0], block_stride=strides[1])
    raw = torch.zeros(tensor.size, dtype=torch.uint8)
    return create_kv_cache_views(raw, spec, B, layout, tensor)


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_vllm_views_are_taken_or_refused_by_layout(layout, mla):
    got = vllm_views(layout, mla)
    heads, content = (1, LATENT) if mla else (HEADS, 2 * DIM)
    ours = kv_views.views(torch, layout.name, L, B, heads, BS, content, torch.bfloat16, fill=False)
    # The test's own view builder (used on the GPU, where vLLM is not) is vLLM's.
    for a, b in zip(got, ours):
        assert a.shape == b.shape and a.stride() == b.stride(), layout.name
        assert a.data_ptr() - got[0].data_ptr() == b.data_ptr() - ours[0].data_ptr()

    compact = layout.name[:2] in ("LB", "BL")
    if not compact and not (mla and layout.name in ("LHBNC", "BHLNC")):
        with pytest.raises(orbitkv.InvalidArgument, match="not one dense run|apart"):
            GpuKvCache(got, mla=mla)
        with pytest.raises(ConfigError, match="VLLM_KV_CACHE_LAYOUT"):
            page_order(layout.name)
        return
    cache = GpuKvCache(got, mla=mla)
    expected_kind = "cross_layer" if layout.name[0] == "B" else ("mla" if mla else "paged")
    assert cache.kind == expected_kind
    assert cache.chunk_bytes == L * BS * heads * content * 2
    if not mla:
        assert cache.page_order == page_order(layout.name)
    # The server layout describes the same bytes per block.
    _, _, bs, kvh, dim, e = cache.layout_args
    assert L * bs * kvh * dim * e * (1 if cache.kind == "mla" else 2) == cache.chunk_bytes


@pytest.mark.parametrize("mla", [False, True])
def test_chunks_are_pages_layer_by_layer_and_alike_across_lb_and_bl(mla):
    heads, content = (1, LATENT) if mla else (HEADS, 2 * DIM)
    chunks = {}
    for name in ("LBHNC", "LBNHC", "BLHNC", "BLNHC"):
        cache = kv_views.views(torch, name, L, B, heads, BS, content, torch.bfloat16)
        c = GpuKvCache(cache, mla=mla)
        rows = torch.empty(B, c.chunk_bytes, dtype=torch.uint8)
        c.gather(torch.arange(B), rows)
        chunks[name] = [bytes(row.numpy().tobytes()) for row in rows]
        for block in range(B):
            assert chunks[name][block] == kv_views.reference_chunk(torch, cache, block, c.page_order), (name, block)
    assert chunks["LBHNC"] == chunks["BLHNC"]
    assert chunks["LBNHC"] == chunks["BLNHC"]
    assert chunks["LBHNC"] != chunks["LBNHC"] or mla


def test_bad_caches_are_refused_naming_what_is_wrong():
    cache = kv_views.views(torch, "LBNHC", L, B, HEADS, BS, 2 * DIM, torch.bfloat16, fill=False)
    with pytest.raises(orbitkv.InvalidArgument, match="no KV cache"):
        GpuKvCache([])
    with pytest.raises(orbitkv.InvalidArgument, match="layer 1"):
        GpuKvCache([cache[0], cache[1].to(torch.float16)])
    with pytest.raises(orbitkv.InvalidArgument, match="shape"):
        GpuKvCache([cache[0], cache[1][:, :1]])
    with pytest.raises(orbitkv.InvalidArgument, match=r"\[blocks, heads, tokens, content\]"):
        GpuKvCache([c.flatten(1) for c in cache])
    with pytest.raises(orbitkv.InvalidArgument, match="block 6 of 6"):
        GpuKvCache(cache).check_blocks([B], distinct=False)
    # Layers out of order are not one cross-layer tensor.
    bl = kv_views.views(torch, "BLNHC", L, B, HEADS, BS, 2 * DIM, torch.bfloat16, fill=False)
    with pytest.raises(orbitkv.InvalidArgument, match="cross-layer"):
        GpuKvCache(list(reversed(bl)))


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLNHC"])
def test_gather_and_scatter_move_whole_chunks(layout):
    src = kv_views.views(torch, layout, L, B, HEADS, BS, 2 * DIM, torch.bfloat16)
    dst = kv_views.views(torch, layout, L, B, HEADS, BS, 2 * DIM, torch.bfloat16, fill=False)
    a, b = GpuKvCache(src), GpuKvCache(dst)
    rows = torch.empty(3, a.chunk_bytes, dtype=torch.uint8)
    a.gather(torch.tensor([4, 0, 2]), rows)
    for row, block in zip(rows, [4, 0, 2]):
        assert bytes(row.numpy().tobytes()) == kv_views.reference_chunk(torch, src, block, a.page_order)
    b.scatter(torch.tensor([1, 5, 3]), rows)
    for x, y in zip(dst, src):
        assert torch.equal(x[[1, 5, 3]], y[[4, 0, 2]])
        assert not x[[0, 2, 4]].any()


def test_one_head_pages_match_either_order():
    """With one KV head per rank (a 70B model at TP=8) LBNHC and LBHNC pages are the same
    bytes: the worker must take either layout name."""
    for name in ("LBNHC", "LBHNC"):
        c = GpuKvCache(kv_views.views(torch, name, L, B, 1, BS, 2 * DIM, torch.bfloat16, fill=False))
        assert c.matches("NHC") and c.matches("HNC")
    c = GpuKvCache(kv_views.views(torch, "LBNHC", L, B, HEADS, BS, 2 * DIM, torch.bfloat16, fill=False))
    assert c.matches("NHC") and not c.matches("HNC")
    with pytest.raises(orbitkv.InvalidArgument, match="block 6 of 6"):
        c.check_blocks([0, 6], distinct=False)
    with pytest.raises(orbitkv.InvalidArgument, match="block 2 named twice"):
        c.check_blocks([2, 1, 2], distinct=True)
