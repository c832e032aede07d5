"""`GpuKvCache`: an engine's paged KV cache on one GPU, read from its per-layer tensors."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

from .._native import InvalidArgument
from .ipc import ipc_triple


def _dense_page(t: Any) -> Tuple[int, str]:
    """(bytes, order) of one block's page in a `[blocks, H, N, C]` view whose page is dense
    (its H, N and C dims cover one contiguous run, C innermost): order `HNC` or `NHC`."""
    if t.dim() != 4:
        raise InvalidArgument(f"a paged KV cache view is [blocks, heads, tokens, content]; got shape {tuple(t.shape)}")
    _, h, n, c = (int(x) for x in t.shape)
    e = t.element_size()
    sh, sn, sc = (int(t.stride(i)) for i in (1, 2, 3))
    if c > 1 and sc != 1:
        raise InvalidArgument(f"the innermost dim of a KV page must be dense (strides {tuple(t.stride())})")
    order = "HNC" if h == 1 or n == 1 or sh > sn else "NHC"
    inner = {"HNC": ((n, sn), (h, sh)), "NHC": ((h, sh), (n, sn))}[order]
    expect = c
    for size, stride in inner:
        if size > 1 and stride != expect:
            raise InvalidArgument(
                f"a KV page of shape {tuple(t.shape)} with strides {tuple(t.stride())} is not one dense run of bytes"
            )
        expect *= size
    return h * n * c * e, order


class GpuKvCache:
    """An engine rank's paged KV cache on one GPU, read from its per-layer tensors: each a
    `[blocks, heads, tokens, content]` view (vLLM >= 0.32; MLA with one head) whose block
    pages are dense runs of bytes. A chunk is one block of every layer, layer by layer, each
    page's bytes in the engine's order.

    Two shapes are recognised, and both give the same chunk bytes:
    - per layer (vLLM's LBNHC/LBHNC): the layer's pages back to back, server layout `paged`
      (`mla` for MLA);
    - cross-layer (BLNHC/BLHNC): one tensor whose blocks hold every layer's page in turn,
      server layout `cross_layer`.
    Anything else (padded pages, heads outside blocks) is refused, naming what was found.

    `regions()` gives what `Client.register_gpu` takes (the server's DMA threads copy);
    `gather` / `scatter` move whole chunks for `EngineCopies.save_cache` / `load_cache` (the
    engine copies).
    """

    def __init__(self, layers: Sequence[Any], *, mla: bool = False) -> None:
        if not layers:
            raise InvalidArgument("no KV cache tensors")
        self.device = layers[0].device
        self.dtype = layers[0].dtype
        self.mla = mla
        for i, t in enumerate(layers):
            if t.device != self.device or t.dtype != self.dtype:
                raise InvalidArgument(f"layer {i} is {t.dtype} on {t.device}, layer 0 {self.dtype} on {self.device}")
            if t.shape != layers[0].shape or t.stride() != layers[0].stride():
                raise InvalidArgument(f"layer {i} has shape {tuple(t.shape)} strides {tuple(t.stride())}, "
                                      f"layer 0 {tuple(layers[0].shape)} {tuple(layers[0].stride())}")
        self.num_layers = len(layers)
        self.num_blocks = int(layers[0].shape[0])
        e = layers[0].element_size()
        self.page_bytes, self.page_order = _dense_page(layers[0])
        _, self.heads, self.block_size, content = (int(x) for x in layers[0].shape)
        stride = int(layers[0].stride(0)) * e
        ptrs = [int(t.data_ptr()) for t in layers]
        storage = layers[0].untyped_storage()
        same_storage = all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in layers)
        if stride == self.page_bytes:
            self.kind = "mla" if mla else "paged"
            self._slabs = [self._slab(t, self.num_blocks * self.page_bytes) for t in layers]
        elif (same_storage and stride == self.num_layers * self.page_bytes
              and all(p == ptrs[0] + i * self.page_bytes for i, p in enumerate(ptrs))):
            self.kind = "cross_layer"
            self._slabs = [self._slab(layers[0], self.num_blocks * stride)]
        else:
            raise InvalidArgument(
                f"KV pages of {self.page_bytes} bytes lie {stride} bytes apart, and the layers are not one "
                "cross-layer tensor in order: OrbitKV copies dense per-layer pages (vLLM's LBNHC/LBHNC) or "
                "cross-layer blocks (BLNHC/BLHNC)"
            )
        self.chunk_bytes = self.num_layers * self.page_bytes
        # The server's layout of the same bytes: per-token K and V halves for FlashAttention
        # pages, the latent row for MLA.
        if self.kind == "mla":
            self.layout_args = (self.num_layers, self.num_blocks, self.block_size, 1, self.heads * content, e)
        else:
            if content % 2:
                raise InvalidArgument(f"a page's content of {content} elements per head cannot be K and V halves")
            self.layout_args = (self.num_layers, self.num_blocks, self.block_size, self.heads, content // 2, e)

    @staticmethod
    def _slab(t: Any, nbytes: int) -> Any:
        """The bytes from `t`'s first element on, as a flat contiguous uint8 tensor."""
        import torch

        storage = t.untyped_storage()
        start = int(t.data_ptr()) - int(storage.data_ptr())
        if start + nbytes > storage.nbytes():
            raise InvalidArgument(f"{nbytes} bytes from offset {start} run past the tensor's storage")
        u = torch.empty(0, dtype=torch.uint8, device=t.device)
        u.set_(storage, start, (nbytes,), (1,))
        return u

    def layout(self) -> Any:
        from .._native import KvLayout

        return KvLayout(self.kind, *self.layout_args)

    def regions(self) -> List[Tuple[bytes, int, int]]:
        """The server layout's tensors as CUDA IPC triples, for `Client.register_gpu`."""
        return [ipc_triple(s) for s in self._slabs]

    def check_blocks(self, blocks: Sequence[int], distinct: bool) -> None:
        """Refuses block ids outside the cache (or named twice, for a load), naming one."""
        bad = next((b for b in blocks if not 0 <= b < self.num_blocks), None)
        if bad is not None:
            raise InvalidArgument(f"block {bad} of {self.num_blocks}")
        if distinct and len(set(blocks)) != len(blocks):
            twice = next(b for i, b in enumerate(blocks) if b in blocks[:i])
            raise InvalidArgument(f"block {twice} named twice: a load writes each block once")

    def matches(self, order: str) -> bool:
        """Whether the pages' byte order is `order` (HNC or NHC): with one head or one token
        per page both orders are the same bytes."""
        return self.page_order == order or self.heads == 1 or self.block_size == 1

    def gather(self, blocks: Any, out: Any) -> None:
        """Chunks of `blocks` (a CUDA index tensor) into the rows of `out` (`[len(blocks),
        chunk_bytes]` uint8, contiguous), on the current stream."""
        import torch

        if self.kind == "cross_layer":
            torch.index_select(self._slabs[0].view(self.num_blocks, -1), 0, blocks, out=out)
            return
        rows = out.view(len(blocks), self.num_layers, self.page_bytes)
        for layer, slab in enumerate(self._slabs):
            rows[:, layer].copy_(slab.view(self.num_blocks, -1).index_select(0, blocks))

    def scatter(self, blocks: Any, chunks: Any) -> None:
        """The rows of `chunks` into blocks `blocks`, on the current stream."""
        if self.kind == "cross_layer":
            self._slabs[0].view(self.num_blocks, -1).index_copy_(0, blocks, chunks)
            return
        rows = chunks.view(len(blocks), self.num_layers, self.page_bytes)
        for layer, slab in enumerate(self._slabs):
            slab.view(self.num_blocks, -1).index_copy_(0, blocks, rows[:, layer])
