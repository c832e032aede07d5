//! The segment math against a reference: the byte offset of every element of a block computed
//! from the full tensor shape and row-major strides.

use super::*;

/// Row-major byte offset of `index` in a tensor of `shape`.
fn offset_of(shape: &[u64], index: &[u64], elem: u64) -> u64 {
    let mut off = 0;
    for (d, &i) in shape.iter().zip(index) {
        assert!(i < *d);
        off = off * d + i;
    }
    off * elem
}

/// Reference: (tensor, byte offset) of every element of `block`, in chunk order (layer, K/V,
/// then the layout's own order inside the block).
fn reference(d: &KvLayoutSpec, block: u64) -> Vec<(u32, u64)> {
    let (l, bs, h, dim, e) = (
        d.num_layers as u64,
        d.block_size as u64,
        d.kv_heads as u64,
        d.head_dim as u64,
        d.elem_bytes as u64,
    );
    let n = d.num_blocks;
    let mut out = Vec::new();
    for layer in 0..l {
        let kvs = if d.kind == KvLayoutKind::MlaPerLayer { 1 } else { 2 };
        for t in 0..kvs {
            match d.kind {
                KvLayoutKind::FlashAttnNhd => {
                    for s in 0..bs {
                        for hh in 0..h {
                            for x in 0..dim {
                                out.push((
                                    layer as u32,
                                    offset_of(&[2, n, bs, h, dim], &[t, block, s, hh, x], e),
                                ));
                            }
                        }
                    }
                }
                KvLayoutKind::FlashAttnHnd => {
                    for hh in 0..h {
                        for s in 0..bs {
                            for x in 0..dim {
                                out.push((
                                    layer as u32,
                                    offset_of(&[2, n, h, bs, dim], &[t, block, hh, s, x], e),
                                ));
                            }
                        }
                    }
                }
                KvLayoutKind::CrossLayer => {
                    for s in 0..bs {
                        for hh in 0..h {
                            for x in 0..dim {
                                out.push((
                                    0,
                                    offset_of(
                                        &[n, l, 2, bs, h, dim],
                                        &[block, layer, t, s, hh, x],
                                        e,
                                    ),
                                ));
                            }
                        }
                    }
                }
                KvLayoutKind::MlaPerLayer => {
                    for s in 0..bs {
                        for x in 0..dim {
                            out.push((layer as u32, offset_of(&[n, bs, dim], &[block, s, x], e)));
                        }
                    }
                }
                // The page is opaque: its bytes in order, K half then V half.
                KvLayoutKind::Paged => {
                    for x in 0..bs * h * dim {
                        out.push((
                            layer as u32,
                            offset_of(&[n, 2, bs * h * dim], &[block, t, x], e),
                        ));
                    }
                }
                KvLayoutKind::SglangPerLayer => {
                    for hh in 0..h {
                        for x in 0..dim {
                            out.push((
                                (2 * layer + t) as u32,
                                offset_of(&[n, h, dim], &[block, hh, x], e),
                            ));
                        }
                    }
                }
            }
        }
    }
    out
}

/// Expands segments into per-element (tensor, offset), in order.
fn expand(segs: &[Segment], elem: u64) -> Vec<(u32, u64)> {
    segs.iter()
        .flat_map(|s| (0..s.len / elem).map(move |i| (s.tensor, s.offset + i * elem)))
        .collect()
}

fn desc(layout: KvLayoutKind) -> KvLayoutSpec {
    let (block_size, kv_heads) = match layout {
        KvLayoutKind::SglangPerLayer => (1, 3),
        KvLayoutKind::MlaPerLayer => (4, 1),
        _ => (4, 3),
    };
    KvLayoutSpec {
        kind: layout,
        num_layers: 3,
        num_blocks: 5,
        block_size,
        kv_heads,
        head_dim: 8,
        elem_bytes: 2,
    }
}

#[test]
fn every_layout_matches_the_reference() {
    for layout in [
        KvLayoutKind::FlashAttnNhd,
        KvLayoutKind::FlashAttnHnd,
        KvLayoutKind::CrossLayer,
        KvLayoutKind::MlaPerLayer,
        KvLayoutKind::SglangPerLayer,
        KvLayoutKind::Paged,
    ] {
        let d = desc(layout);
        d.validate().unwrap();
        let tensor_bytes = d.tensor_bytes().unwrap();
        for block in 0..d.num_blocks {
            let segs = d.block_segments(block);
            assert_eq!(expand(&segs, 2), reference(&d, block), "{layout:?} block {block}");
            assert_eq!(segs.iter().map(|s| s.len).sum::<u64>(), d.block_bytes());
            for s in &segs {
                assert!(
                    s.tensor < d.tensor_count() && s.offset + s.len <= tensor_bytes,
                    "{layout:?} {s:?}"
                );
            }
        }
    }
}

#[test]
fn part_bases_and_stride_give_every_part() {
    // Tensors far apart, as separate allocations are: a base pointing into the wrong tensor
    // would show.
    let tensors: Vec<u64> = (0..8).map(|i| (i + 1) << 32).collect();
    for layout in [
        KvLayoutKind::FlashAttnNhd,
        KvLayoutKind::FlashAttnHnd,
        KvLayoutKind::CrossLayer,
        KvLayoutKind::MlaPerLayer,
        KvLayoutKind::SglangPerLayer,
        KvLayoutKind::Paged,
    ] {
        let d = desc(layout);
        let (bases, stride) = d.part_bases(&tensors);
        assert_eq!(bases.len() as u64, d.parts_per_block(), "{layout:?}");
        assert_eq!(d.part_len() * d.parts_per_block(), d.block_bytes(), "{layout:?}");
        for block in 0..d.num_blocks {
            let mut p = 0;
            d.for_each_part(block, |seg| {
                assert_eq!(seg.len, d.part_len(), "{layout:?}");
                assert_eq!(
                    bases[p] + block * stride,
                    tensors[seg.tensor as usize] + seg.offset,
                    "{layout:?} block {block} part {p}"
                );
                p += 1;
            });
            assert_eq!(p, bases.len());
        }
    }
}

#[test]
fn cross_layer_blocks_are_one_segment() {
    let d = desc(KvLayoutKind::CrossLayer);
    assert_eq!(d.block_segments(2).len(), 1);
    // FlashAttention: one segment per layer and K/V; paged: one per layer.
    assert_eq!(desc(KvLayoutKind::FlashAttnNhd).block_segments(2).len(), 6);
    assert_eq!(desc(KvLayoutKind::Paged).block_segments(2).len(), 3);
}

#[test]
fn validation_names_the_field() {
    let d = desc(KvLayoutKind::FlashAttnNhd);
    assert_eq!(KvLayoutSpec { head_dim: 0, ..d }.validate().unwrap_err().field, "head_dim");
    assert_eq!(KvLayoutSpec { elem_bytes: 3, ..d }.validate().unwrap_err().field, "elem_bytes");
    let s = desc(KvLayoutKind::SglangPerLayer);
    assert_eq!(KvLayoutSpec { block_size: 16, ..s }.validate().unwrap_err().field, "block_size");
    let m = desc(KvLayoutKind::MlaPerLayer);
    assert_eq!(KvLayoutSpec { kv_heads: 8, ..m }.validate().unwrap_err().field, "kv_heads");
    let huge = KvLayoutSpec { num_blocks: u64::MAX, ..d };
    assert_eq!(huge.validate().unwrap_err().field, "num_blocks");
}

#[test]
fn oversized_shapes_are_refused_without_overflow() {
    let base = KvLayoutSpec {
        kind: KvLayoutKind::FlashAttnNhd,
        num_layers: 2,
        num_blocks: 8,
        block_size: 16,
        kv_heads: 8,
        head_dim: 128,
        elem_bytes: 2,
    };
    let e = KvLayoutSpec { block_size: u32::MAX, kv_heads: u32::MAX, head_dim: u32::MAX, ..base }
        .validate()
        .unwrap_err();
    assert_eq!(e.field, "head_dim");
    assert!(e.reason.contains("block_size x kv_heads x head_dim"), "{}", e.reason);
    // Named where the product overflows: here at the layers, not at head_dim.
    let e = KvLayoutSpec {
        block_size: u32::MAX,
        kv_heads: u32::MAX,
        head_dim: 1,
        elem_bytes: 1,
        ..base
    }
    .validate()
    .unwrap_err();
    assert_eq!(e.field, "num_layers");
    let e = KvLayoutSpec { num_layers: u32::MAX, ..base }.validate().unwrap_err();
    assert_eq!(e.field, "num_layers");
    let e = KvLayoutSpec { num_blocks: u64::MAX, ..base }.validate().unwrap_err();
    assert_eq!(e.field, "num_blocks");
    assert!(base.validate().is_ok());
}
