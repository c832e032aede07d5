use std::sync::Arc;

use orbitkv_proto::{ChunkOutcome, Dtype, ErrorCode, NamespaceDescriptor, Reservation, SlotRef};

use super::*;
use crate::core::{NamespaceQuota, ShardConfig};
use crate::ops::{ShardOp, ShardReply};
use crate::Arena;
use orbitkv_ssd::store::SsdConfig;

fn core_with_ssd(dram_pages: u64, dir: &std::path::Path) -> (ShardCore, u64) {
    core_with_chunks(dram_pages, dir, 4)
}

/// A shard of `dram_pages` with an SSD tier of 256 KiB regions, and a namespace of chunks up
/// to `tokens_per_chunk` x 4 KiB.
fn core_with_chunks(
    dram_pages: u64,
    dir: &std::path::Path,
    tokens_per_chunk: u32,
) -> (ShardCore, u64) {
    core_with_quota(dram_pages, dir, tokens_per_chunk, NamespaceQuota::default(), vec![])
}

/// [`core_with_chunks`] whose namespaces have `quota`, or their model's in `models`.
fn core_with_quota(
    dram_pages: u64,
    dir: &std::path::Path,
    tokens_per_chunk: u32,
    quota: NamespaceQuota,
    model_quotas: Vec<(String, NamespaceQuota)>,
) -> (ShardCore, u64) {
    let arena = Arc::new(Arena::create(dram_pages * 4096, false).unwrap());
    let slice = arena.split(1).pop().unwrap();
    let cfg =
        ShardConfig { id: 0, max_chunk_bytes: 1 << 30, max_namespaces: 4, quota, model_quotas };
    let mut core = ShardCore::new(cfg, slice);
    let ns = descriptor("t", tokens_per_chunk);
    let id = ns.id();
    assert!(matches!(
        core.apply(ShardOp::Register { descriptor: ns }),
        ShardReply::Registered(Ok(_))
    ));
    let (store, _) = SsdStore::open(&ssd_config(dir)).unwrap();
    core.attach_ssd(store);
    (core, id)
}

/// A namespace of `model` with chunks of `tokens_per_chunk` x 4 KiB.
fn descriptor(model: &str, tokens_per_chunk: u32) -> NamespaceDescriptor {
    NamespaceDescriptor {
        model: model.into(),
        dtype: Dtype::Fp32,
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 512,
        kv_tensors: 2,
        tokens_per_chunk,
        layout_version: 1,
        tp_rank: 0,
        tp_world_size: 1,
    }
}

/// The SSD store of the test shards: 8 MiB in 256 KiB regions.
fn ssd_config(dir: &std::path::Path) -> SsdConfig {
    SsdConfig {
        dir: dir.to_owned(),
        shard_id: 0,
        shard_count: 1,
        capacity_bytes: 8 << 20,
        region_bytes: 256 << 10,
        ring_depth: 8,
        inject_delay: std::time::Duration::ZERO,
        inject_errors_every: 0,
        inject_no_space_every: 0,
    }
}

fn key(ns: u64, i: u32) -> ChunkKey {
    let mut d = [0u8; 32];
    d[..4].copy_from_slice(&i.to_le_bytes());
    ChunkKey::new(ns, d)
}

fn fill(i: u32, len: u64) -> Vec<u8> {
    (0..len).map(|b| (b as u32).wrapping_mul(131).wrapping_add(i) as u8).collect()
}

fn put(core: &mut ShardCore, k: ChunkKey, i: u32, len: u64) -> Result<(), ErrorCode> {
    let r = core.apply(ShardOp::Reserve { session: 1, keys: vec![k], lens: vec![len] });
    let ShardReply::Reserved(r) = r else { panic!() };
    match r[0] {
        Reservation::Slot { offset, generation, .. } => {
            core.slice.write(offset - core.slice.offset(), &fill(i, len));
            let c = core
                .apply(ShardOp::Commit { session: 1, slots: vec![SlotRef { key: k, generation }] });
            assert!(
                matches!(c, ShardReply::Outcomes(ref o) if o[0] == ChunkOutcome::Done),
                "{c:?}"
            );
            Ok(())
        }
        Reservation::Failed(code) => Err(code),
    }
}

/// Runs the shard's background work until no SSD operation is in flight.
fn settle(core: &mut ShardCore) {
    loop {
        core.maintain();
        core.poll_ssd();
        if core.ssd_inflight() == 0 {
            core.maintain();
            if core.ssd_inflight() == 0 {
                return;
            }
        }
        std::thread::yield_now();
    }
}

fn get(core: &mut ShardCore, k: ChunkKey, lease: bool) -> Option<Hit> {
    let first = core.lookup_start(2, &[k], lease);
    while first.pending.iter().any(|_| core.promotion_pending(&k)) {
        core.poll_ssd();
        std::thread::yield_now();
    }
    core.finish_lookup(2, &[k], lease, first)[0]
}

/// A 64-page shard that has taken 200 chunks of 4000 bytes (each read once, so that it is
/// worth demoting), most of them moved down to SSD.
fn filled_core(dir: &std::path::Path) -> (ShardCore, u64) {
    let (mut core, ns) = core_with_ssd(64, dir);
    for i in 0..200 {
        put(&mut core, key(ns, i), i, 4000).unwrap();
        assert!(get(&mut core, key(ns, i), false).is_some());
        settle(&mut core);
    }
    (core, ns)
}

#[test]
fn chunks_move_down_to_ssd_and_come_back_exact() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let (mut core, ns) = core_with_ssd(64, dir.path()); // 256 KiB of DRAM, 4 KiB chunks
    for i in 0..200 {
        put(&mut core, key(ns, i), i, 4000).unwrap();
        // Reading each chunk once gives it reuse evidence for admission.
        assert!(get(&mut core, key(ns, i), false).is_some());
        settle(&mut core);
    }
    let stats = core.stats();
    assert!(stats.demotions > 100, "{stats:?}");
    assert!(stats.dram_used_bytes <= 64 * 4096);
    // Every chunk is somewhere, and comes back byte-exact; the demoted ones from SSD.
    let mut from_ssd = 0;
    for i in 0..200 {
        let hit = get(&mut core, key(ns, i), true).unwrap_or_else(|| panic!("chunk {i} lost"));
        if hit.tier == Tier::Ssd {
            from_ssd += 1;
        }
        let bytes = core.slice.bytes(hit.offset - core.slice.offset(), hit.len);
        assert_eq!(bytes, &fill(i, 4000)[..], "chunk {i}");
        let released = core.apply(ShardOp::Release {
            session: 2,
            slots: vec![SlotRef { key: key(ns, i), generation: hit.generation }],
        });
        assert!(
            matches!(released, ShardReply::Outcomes(ref o) if o == &[ChunkOutcome::Done]),
            "{released:?}"
        );
        settle(&mut core);
    }
    assert!(from_ssd > 100);
    let stats = core.stats();
    assert!(stats.promotions >= from_ssd);
    assert_eq!(stats.ssd.unwrap().checksum_failures, 0);
    // Explicit evict removes a chunk from both tiers.
    let ShardReply::Outcomes(o) = core.apply(ShardOp::Evict { keys: vec![key(ns, 5)] }) else {
        panic!()
    };
    assert_eq!(o, vec![ChunkOutcome::Done]);
    assert!(get(&mut core, key(ns, 5), false).is_none());
}

#[test]
fn a_leased_chunk_is_never_demoted_away() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let (mut core, ns) = core_with_ssd(32, dir.path());
    put(&mut core, key(ns, 0), 0, 4000).unwrap();
    let held = get(&mut core, key(ns, 0), true).unwrap();
    for i in 1..100 {
        put(&mut core, key(ns, i), i, 4000).unwrap();
        get(&mut core, key(ns, i), false);
        settle(&mut core);
        let bytes = core.slice.bytes(held.offset - core.slice.offset(), held.len);
        assert_eq!(bytes, &fill(0, 4000)[..]);
    }
    assert_eq!(get(&mut core, key(ns, 0), false).map(|h| h.tier), Some(Tier::Dram));
}

#[test]
fn evict_during_a_promotion_is_busy_and_the_chunk_stays_consistent() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let (mut core, ns) = filled_core(dir.path());
    // Find a chunk that lives only on SSD and start its promotion.
    let k = (0..200).map(|i| key(ns, i)).find(|k| core.entries.find(k).is_none()).unwrap();
    let first = core.lookup_start(3, &[k], false);
    assert_eq!(first.pending, vec![0]);
    let ShardReply::Outcomes(o) = core.apply(ShardOp::Evict { keys: vec![k] }) else { panic!() };
    assert_eq!(o, vec![ChunkOutcome::Failed(ErrorCode::Busy)]);
    while core.promotion_pending(&k) {
        core.poll_ssd();
        std::thread::yield_now();
    }
    assert!(core.finish_lookup(3, &[k], false, first)[0].is_some());
    // Once promoted and unpinned, evict removes it from both tiers.
    let ShardReply::Outcomes(o) = core.apply(ShardOp::Evict { keys: vec![k] }) else { panic!() };
    assert_eq!(o, vec![ChunkOutcome::Done]);
    assert!(get(&mut core, k, false).is_none());
}

/// Demotions under way count toward the free target: a shard short of one page starts one,
/// not one per free ring slot (which left every chunk demoting, none evictable, and a put
/// meanwhile without room).
#[test]
fn demotions_stop_once_enough_are_under_way() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let (mut core, ns) = core_with_ssd(16, dir.path());
    for i in 0..8 {
        put(&mut core, key(ns, i), i, 8000).unwrap();
        assert!(get(&mut core, key(ns, i), false).is_some());
    }
    settle(&mut core);
    put(&mut core, key(ns, 50), 50, 8000).unwrap();
    assert!(get(&mut core, key(ns, 50), false).is_some());
    let started = core.maintain();
    assert_eq!(started, 1, "one two-page chunk brings a 16-page shard to its free target");
    put(&mut core, key(ns, 100), 100, 8000).unwrap();
    settle(&mut core);
    assert_eq!(core.demoting_pages, 0);
}

/// A chunk longer than a region less its header never fits on SSD: it is evicted, counted
/// as an admission refusal, and the shard keeps taking chunks.
#[test]
fn a_chunk_larger_than_a_region_is_evicted_and_counted() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    // 64 tokens x 4 KiB: 256 KiB chunks, as large as a region.
    let (mut core, ns) = core_with_chunks(256, dir.path(), 64);
    for i in 0..20 {
        put(&mut core, key(ns, i), i, 256 << 10).unwrap();
        assert!(get(&mut core, key(ns, i), false).is_some());
        settle(&mut core);
    }
    let s = core.stats();
    assert_eq!(s.demotions, 0);
    assert!(s.admission_rejections > 0, "{s:?}");
    assert_eq!(s.admission_rejections, s.evictions, "{s:?}");
    assert!(get(&mut core, key(ns, 19), false).is_some());
}

/// A promotion that fails its checksum is a miss, not an SSD hit.
#[test]
fn a_failed_promotion_is_a_miss() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let (mut core, ns) = filled_core(dir.path());
    let k = (0..200).map(|i| key(ns, i)).find(|k| core.entries.find(k).is_none()).unwrap();
    let e = core.ssd.as_ref().unwrap().get(&k).unwrap();
    let path = core.ssd.as_ref().unwrap().path().to_owned();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        f.write_all_at(&[0xAA; 16], e.payload_offset()).unwrap();
        f.sync_all().unwrap();
    }
    let before = core.stats();
    assert!(get(&mut core, k, false).is_none());
    let after = core.stats();
    assert_eq!(after.misses, before.misses + 1);
    assert_eq!(after.ssd_hits, before.ssd_hits);
    // A good one still counts as an SSD hit.
    let good = (0..200).map(|i| key(ns, i)).find(|g| *g != k && core.entries.find(g).is_none());
    assert!(get(&mut core, good.unwrap(), false).is_some());
    assert_eq!(core.stats().ssd_hits, after.ssd_hits + 1);
    assert_eq!(core.stats().misses, after.misses);
}

/// A namespace at its SSD share has its victims dropped, not written: its records stay under
/// the share, the drops are counted, and the audit agrees.
#[test]
fn a_namespace_at_its_ssd_limit_is_not_demoted_past_it() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    // Forty records of 4000 bytes.
    let quota = NamespaceQuota { ssd_limit_bytes: 40 * 8192, ..Default::default() };
    let (mut core, ns) = core_with_quota(64, dir.path(), 4, quota, vec![]);
    for i in 0..200 {
        put(&mut core, key(ns, i), i, 4000).unwrap();
        assert!(get(&mut core, key(ns, i), false).is_some());
        settle(&mut core);
    }
    let stats = core.stats();
    let ssd = core.ssd.as_ref().unwrap();
    assert!(ssd.namespace_bytes(ns) <= 40 * 8192, "{}", ssd.namespace_bytes(ns));
    assert_eq!(stats.ssd.unwrap().records, 40, "{stats:?}");
    assert!(stats.ssd_quota_drops > 100, "{stats:?}");
    assert!(core.audit().problems.is_empty(), "{:?}", core.audit().problems);
}

/// Registers a namespace of model `model` with chunks of 4 x 4 KiB.
fn register_model(core: &mut ShardCore, model: &str) -> u64 {
    let d = descriptor(model, 4);
    let id = d.id();
    assert!(matches!(
        core.apply(ShardOp::Register { descriptor: d }),
        ShardReply::Registered(Ok(_))
    ));
    id
}

/// A quiet namespace with an SSD guarantee keeps that much of its records through a noisy
/// one cycling the log: reclaim rewrites them at the head first (each byte-exact, also after
/// a restart). Without the guarantee, reclaim takes them all.
#[test]
fn a_quiet_namespace_keeps_its_ssd_guarantee_through_reclaim() {
    const KEPT: u64 = 24;
    for guarantee in [0, KEPT * 8192] {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let quiet_quota = NamespaceQuota { ssd_guarantee_bytes: guarantee, ..Default::default() };
        let models = vec![("quiet".to_string(), quiet_quota)];
        let (mut core, noisy) =
            core_with_quota(64, dir.path(), 4, NamespaceQuota::default(), models);
        let quiet = register_model(&mut core, "quiet");
        for i in 0..30 {
            put(&mut core, key(quiet, i), i, 4000).unwrap();
            assert!(get(&mut core, key(quiet, i), false).is_some());
            settle(&mut core);
        }
        // 1,500 records of 8 KiB through an 8 MiB log: it wraps about one and a half times.
        for i in 0..1500 {
            put(&mut core, key(noisy, i), i, 4000).unwrap();
            assert!(get(&mut core, key(noisy, i), false).is_some());
            settle(&mut core);
        }
        let ssd = core.ssd.as_ref().unwrap();
        let kept = ssd.namespace_bytes(quiet);
        let relocated = ssd.stats().relocated;
        assert!(core.audit().problems.is_empty(), "{:?}", core.audit().problems);
        if guarantee == 0 {
            assert_eq!((kept, relocated), (0, 0), "no guarantee: reclaim takes them");
            continue;
        }
        assert!((KEPT * 8192..=30 * 8192).contains(&kept), "{kept} bytes kept");
        assert!(relocated >= KEPT, "{relocated} records rewritten");
        let on_ssd: Vec<u32> =
            (0..30).filter(|&i| core.ssd.as_ref().unwrap().get(&key(quiet, i)).is_some()).collect();
        // Byte-exact from SSD (released at once: the lookup leased nothing).
        for &i in &on_ssd {
            let hit = get(&mut core, key(quiet, i), false).unwrap();
            assert_eq!(hit.tier, Tier::Ssd, "{i}");
            let bytes = core.slice.bytes(hit.offset - core.slice.offset(), hit.len);
            assert_eq!(bytes, &fill(i, 4000)[..], "chunk {i}");
        }
        assert_eq!(core.stats().ssd.unwrap().checksum_failures, 0);
        // The rewritten records are what a restart finds.
        settle(&mut core);
        let before: Vec<ChunkKey> =
            core.ssd.as_ref().unwrap().keys().filter(|k| k.namespace == quiet).copied().collect();
        drop(core);
        let (store, _) = SsdStore::open(&ssd_config(dir.path())).unwrap();
        let mut after: Vec<ChunkKey> =
            store.keys().filter(|k| k.namespace == quiet).copied().collect();
        let mut before = before;
        before.sort_by_key(|k| k.digest);
        after.sort_by_key(|k| k.digest);
        assert_eq!(after, before);
        assert!(store.audit().is_empty(), "{:?}", store.audit());
    }
}

/// On a failing disk (every third SSD I/O fails) a guarantee's rewrites fail too: their
/// region is then reclaimed anyway (counted), so demotions never wait on it for good, and
/// every byte served is right.
#[test]
fn an_ssd_guarantee_gives_way_to_a_failing_disk() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let quiet_quota = NamespaceQuota { ssd_guarantee_bytes: 24 * 8192, ..Default::default() };
    let models = vec![("quiet".to_string(), quiet_quota)];
    let (mut core, noisy) = core_with_quota(64, dir.path(), 4, NamespaceQuota::default(), models);
    core.ssd = None;
    let failing = SsdConfig { inject_errors_every: 3, ..ssd_config(dir.path()) };
    core.attach_ssd(SsdStore::open(&failing).unwrap().0);
    let quiet = register_model(&mut core, "quiet");
    for i in 0..30 {
        put(&mut core, key(quiet, i), i, 4000).unwrap();
        get(&mut core, key(quiet, i), false);
        settle(&mut core);
    }
    for i in 0..1500 {
        put(&mut core, key(noisy, i), i, 4000).unwrap();
        get(&mut core, key(noisy, i), false);
        settle(&mut core);
    }
    let stats = core.stats().ssd.unwrap();
    assert!(stats.io_errors > 100, "{stats:?}");
    assert!(stats.reclaimed > 300, "the log went on: {stats:?}");
    assert!(stats.relocations_abandoned > 0, "{stats:?}");
    for i in 0..30 {
        if let Some(hit) = get(&mut core, key(quiet, i), false) {
            let bytes = core.slice.bytes(hit.offset - core.slice.offset(), hit.len);
            assert_eq!(bytes, &fill(i, 4000)[..], "chunk {i}");
        }
    }
    assert!(core.audit().problems.is_empty(), "{:?}", core.audit().problems);
}
