//! An engine's host blocks (strided regions, several blocks per chunk) saved as chunks and
//! loaded back into other blocks: byte-exact, prefix-wise, refusing bad block ids and
//! reporting a chunk of another layout per key.

use orbitkv_client::{BlockLayout, ChunkOutcome, ErrorCode, PutOutcome};
use orbitkv_testkit::{chain, namespace, value_for, TestServer};

const BLOCKS: usize = 16;

/// Two regions as an engine's two layers: 96-byte blocks dense, and 64-byte blocks every 128.
fn regions(seed: u8) -> (Vec<u8>, Vec<u8>) {
    let a: Vec<u8> =
        (0..96 * BLOCKS).map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed)).collect();
    let b: Vec<u8> = (0..128 * BLOCKS).map(|i| (i as u8).wrapping_mul(13) ^ seed).collect();
    (a, b)
}

const A: BlockLayout = BlockLayout { block_bytes: 96, block_stride: 96 };
const B: BlockLayout = BlockLayout { block_bytes: 64, block_stride: 128 };

#[test]
fn blocks_saved_then_loaded_into_other_blocks_are_byte_exact() {
    let server = TestServer::start(&["--shards", "2", "--dram", "16MiB"]);
    let mut c = server.client("engine");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 3, 4);
    let (a, b) = regions(5);
    // Chunk i holds blocks 2i+1 and 2i+2 (two per chunk).
    let saved: Vec<u64> = (0..8).map(|i| i + 1).collect();
    let out = c.save_blocks(&[(&a, A), (&b, B)], &keys, &saved).unwrap();
    assert_eq!(out, vec![PutOutcome::Stored; 4]);
    // Saved again: already there, nothing copied.
    let again = c.save_blocks(&[(&a, A), (&b, B)], &keys[..1], &saved[..2]).unwrap();
    assert_eq!(again, vec![PutOutcome::AlreadyPresent]);

    // Load the first three chunks into blocks 15..10 of fresh regions.
    let (mut a2, mut b2) = (vec![0u8; a.len()], vec![0u8; b.len()]);
    let target: Vec<u64> = vec![15, 14, 13, 12, 11, 10];
    let out =
        c.load_blocks(&mut [(&mut a2[..], A), (&mut b2[..], B)], &keys[..3], &target).unwrap();
    assert_eq!(out, vec![ChunkOutcome::Done; 3]);
    for (&from, &to) in saved.iter().zip(&target) {
        let (f, t) = (from as usize, to as usize);
        assert_eq!(a2[t * 96..t * 96 + 96], a[f * 96..f * 96 + 96], "block {from} -> {to}");
        assert_eq!(b2[t * 128..t * 128 + 64], b[f * 128..f * 128 + 64], "block {from} -> {to}");
        assert!(b2[t * 128 + 64..t * 128 + 128].iter().all(|&x| x == 0), "the stride's gap");
    }
    assert!(a2[..10 * 96].iter().all(|&x| x == 0), "blocks not named stay as they were");

    // A prefix with a missing chunk in the middle: loaded up to it, NotFound after.
    c.evict(&keys[1..2]).unwrap();
    let mut a3 = vec![0u8; a.len()];
    let mut b3 = vec![0u8; b.len()];
    let out = c.load_blocks(&mut [(&mut a3[..], A), (&mut b3[..], B)], &keys, &saved).unwrap();
    let missing = ChunkOutcome::Failed(ErrorCode::NotFound);
    assert_eq!(out, vec![ChunkOutcome::Done, missing, missing, missing]);
    assert_eq!(a3[96..288], a[96..288]);
    assert!(a3[288..].iter().all(|&x| x == 0));
    c.flush().unwrap();
    assert_eq!(server.shard_sum("leases"), 0, "the load's leases were given back");
}

#[test]
fn bad_blocks_are_refused_and_another_layouts_chunk_is_reported() {
    let server = TestServer::start(&["--shards", "1", "--dram", "8MiB"]);
    let mut c = server.client("engine");
    let ns = c.register_namespace(&namespace(16)).unwrap().id;
    let keys = chain(ns, 4, 2);
    let (a, b) = regions(1);
    let err = c.save_blocks(&[(&a, A), (&b, B)], &keys[..1], &[BLOCKS as u64]).unwrap_err();
    assert!(err.to_string().contains("block 16 lies outside region 0"), "{err}");
    let err = c.save_blocks(&[(&a, A)], &keys, &[0, 1, 2]).unwrap_err();
    assert!(err.to_string().contains("3 block ids for 2 keys"), "{err}");
    assert_eq!(server.shard_sum("reservations"), 0, "nothing reserved for a refused save");

    // A chunk put under the same key with another length: reported on that key, not loaded.
    c.put(&[(keys[0], &value_for(&keys[0], 100))]).unwrap();
    let mut a2 = vec![0u8; a.len()];
    let out = c.load_blocks(&mut [(&mut a2[..], A)], &keys, &[0, 1]).unwrap();
    assert_eq!(out[0], ChunkOutcome::Failed(ErrorCode::InvalidArgument));
    assert!(a2.iter().all(|&x| x == 0));
    // The server goes on serving.
    c.ping().unwrap();
}

#[test]
fn large_batches_copy_on_several_threads_byte_exact() {
    let server = TestServer::start(&["--shards", "2", "--dram", "96MiB"]);
    let mut c = orbitkv_client::Client::connect(orbitkv_client::ClientOptions {
        copy_threads: 4,
        ..orbitkv_client::ClientOptions::with_socket(&server.socket)
    })
    .unwrap();
    // Chunks of up to 256 KiB (16 tokens x 4 layers x 2 x 512 x 4 bytes).
    let desc = orbitkv_client::NamespaceDescriptor { num_layers: 4, ..namespace(16) };
    let ns = c.register_namespace(&desc).unwrap().id;
    // 64 chunks of 256 KiB (two 128 KiB regions' blocks): 16 MiB, four threads of 16 chunks.
    const N: usize = 64;
    let half = BlockLayout::dense(128 << 10);
    let a: Vec<u8> =
        (0..N * (128 << 10)).map(|i| (i as u8).wrapping_mul(31) ^ (i >> 17) as u8).collect();
    let b: Vec<u8> = a.iter().map(|x| x.wrapping_add(101)).collect();
    let keys = chain(ns, 11, N);
    let saved: Vec<u64> = (0..N as u64).collect();
    assert_eq!(
        c.save_blocks(&[(&a, half), (&b, half)], &keys, &saved).unwrap(),
        vec![PutOutcome::Stored; N]
    );
    let (mut a2, mut b2) = (vec![0u8; a.len()], vec![0u8; b.len()]);
    let target: Vec<u64> = saved.iter().rev().copied().collect();
    let out =
        c.load_blocks(&mut [(&mut a2[..], half), (&mut b2[..], half)], &keys, &target).unwrap();
    assert_eq!(out, vec![ChunkOutcome::Done; N]);
    let block = 128 << 10;
    for (&from, &to) in saved.iter().zip(&target) {
        let (f, t) = (from as usize * block, to as usize * block);
        assert!(
            a2[t..t + block] == a[f..f + block] && b2[t..t + block] == b[f..f + block],
            "{from} -> {to}"
        );
    }
    // A load naming a block twice would write it twice: refused before anything is leased.
    let err = c.load_blocks(&mut [(&mut a2[..], half)], &keys[..2], &[3, 3]).unwrap_err();
    assert!(err.to_string().contains("block 3 named twice"), "{err}");
    c.flush().unwrap();
    assert_eq!(server.shard_sum("leases"), 0);
}
