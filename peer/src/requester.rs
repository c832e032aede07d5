//! The requester side of peering: a subscription to each member's inventory, kept in the
//! shards' catalog slices (bounded per peer), and the peer reads the shards queue: grant at
//! the owner, Transfer Engine read into the local slot, release, hand back to the shard (which
//! verifies the checksum before anything is served).
//!
//! Peers are numbered per (node id, epoch): a restarted peer is a new peer, its old catalog
//! entries go with the old number. While etcd is unreachable no new remote work starts: the
//! subscriptions end and their catalog entries are dropped, to come back with the members.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use orbitkv_proto::ChunkKey;
use tonic::transport::Endpoint;

use crate::eager::EagerEndChannel as Channel;
use crate::hot::{hot, Warm, HOT_FOR};
use crate::rpc::peer_client::PeerClient;
use crate::rpc::{GrantRequest, InventoryRequest, Key, ReleaseRequest};
use crate::te_c::{POLL_HOT, READ_POLL_HOT};
use crate::{Cluster, Engine, Member, PeeringConfig, State};
use orbitkv_proto::{InventoryChunk, PeerFetch};

/// How often the members are compared with the subscriptions.
const MEMBERS_TICK: Duration = Duration::from_millis(200);
/// Pause before a broken subscription is tried again.
const RESUBSCRIBE_AFTER: Duration = Duration::from_secs(1);
/// How long one grant or release call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Times a release is sent before it is given up (the owner keeps the leases until then).
const RELEASE_TRIES: u32 = 4;
/// Pause before a release is sent again (times the attempt).
const RELEASE_RETRY_AFTER: Duration = Duration::from_millis(250);

/// Where one group read's time went (`ctl peers`).
#[derive(Default)]
struct GroupTimes {
    queue: Duration,
    grant: Duration,
    te_read: Duration,
    handoff: Duration,
    /// Times the TE read's poll slept on the timer (no transfer had ended for a while).
    te_naps: u32,
}

/// Fetches taken from the queue at once (grouped per peer into one grant, one TE batch).
const FETCH_BATCH: usize = crate::FETCHES_PER_MESSAGE;

/// Bytes from which one peer's group is read as two halves at once: the grant of one half
/// then overlaps the other's Transfer Engine read. Measured on the H200 host within the hour:
/// 32 MiB lookups on one shard went from 0.84-0.94 of a raw read to 0.91-1.07; 8 MiB ones
/// (whose TE read is not much longer than a grant) read as halves came to 0.73-0.80 against
/// 0.78-0.83 whole, so they stay whole.
const SPLIT_BYTES: u64 = 16 << 20;

/// `fetches` as one group, or as two halves of about equal bytes when they reach
/// [`SPLIT_BYTES`].
fn halves(mut fetches: Vec<PeerFetch>) -> Vec<Vec<PeerFetch>> {
    let total: u64 = fetches.iter().map(|f| f.len).sum();
    if fetches.len() < 2 || total < SPLIT_BYTES {
        return vec![fetches];
    }
    let mut bytes = 0;
    let cut = fetches
        .iter()
        .position(|f| {
            bytes += f.len;
            bytes * 2 >= total
        })
        .map_or(1, |i| (i + 1).clamp(1, fetches.len() - 1));
    let second = fetches.split_off(cut);
    vec![fetches, second]
}

/// A followed peer.
struct Link {
    index: u32,
    epoch: u64,
    /// The member's Transfer Engine segment.
    segment: String,
    channel: Channel,
    follower: tokio::task::JoinHandle<()>,
}

pub(crate) struct Requester {
    cluster: Arc<Cluster>,
    cfg: Arc<PeeringConfig>,
    te: Engine,
    /// Grant request ids (from 1; 0 means none).
    next_request: std::sync::atomic::AtomicU64,
    /// Polls after each batch of fetches and each group read (the next lookup is likely near).
    warm: Warm,
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("local node calls do not panic")
}

/// Why a peer's inventory stream ended.
#[derive(Debug, thiserror::Error)]
enum StreamBroken {
    /// The RPC failed (its status message).
    #[error("{}", .0.message())]
    Rpc(tonic::Status),
    /// The owner answered for another of its lives.
    #[error("the owner is at epoch {owner}, not {followed}")]
    Epoch {
        /// The owner's epoch in its answer.
        owner: u64,
        /// The epoch followed.
        followed: u64,
    },
}

impl Requester {
    pub(crate) fn new(sides: crate::node::Sides) -> Arc<Self> {
        let crate::node::Sides { cluster, cfg, te, warm } = sides;
        Arc::new(Self { cluster, cfg, te, next_request: 1.into(), warm })
    }

    /// Follows the members and serves the shards' fetches until the runtime stops.
    pub(crate) async fn run(self: Arc<Self>, mut fetches: crate::node::FetchReceiver) {
        let mut links: HashMap<String, Link> = HashMap::new();
        let mut next_index = 0u32;
        let mut tick = tokio::time::interval(MEMBERS_TICK);
        loop {
            tokio::select! {
                _ = tick.tick() => self.reconcile(&mut links, &mut next_index).await,
                first = fetches.recv() => {
                    let Some(first) = first else { return };
                    self.warm.touch();
                    let mut batch = first;
                    while batch.len() < FETCH_BATCH {
                        match fetches.try_recv() {
                            Some(more) => batch.extend(more),
                            None => break,
                        }
                    }
                    self.dispatch(&links, batch).await;
                }
            }
        }
    }

    /// Starts following new members (and new epochs of known ones), stops following those
    /// gone; all of them while etcd is unreachable.
    async fn reconcile(self: &Arc<Self>, links: &mut HashMap<String, Link>, next: &mut u32) {
        let status = self.cluster.status();
        let members: Vec<&Member> = if status.state == State::Joined {
            status
                .members
                .iter()
                .filter(|m| m.node_id != status.node_id && !m.te_segment.is_empty())
                .collect()
        } else {
            Vec::new()
        };
        let gone: Vec<String> = links
            .iter()
            .filter(|(node, l)| !members.iter().any(|m| m.node_id == **node && m.epoch == l.epoch))
            .map(|(node, _)| node.clone())
            .collect();
        for node in gone {
            let link = links.remove(&node).expect("listed above");
            link.follower.abort();
            self.te.forget_segment(&link.segment);
            let n = Arc::clone(&self.cfg.node);
            blocking(move || n.catalog_drop(link.index)).await;
            tracing::info!(peer = %node, epoch = link.epoch, "peer left (or etcd is away): its catalog dropped");
            let mut peers = self.cluster.peers.lock().unwrap_or_else(|e| e.into_inner());
            peers.remove(&node);
        }
        for m in members {
            if links.contains_key(&m.node_id) {
                continue;
            }
            let Ok(endpoint) = Endpoint::from_shared(format!("http://{}", m.peer_addr)) else {
                tracing::warn!(peer = %m.node_id, addr = %m.peer_addr, "a member's peer address is not usable; skipped");
                continue;
            };
            let channel = Channel(endpoint.connect_timeout(CALL_TIMEOUT).connect_lazy());
            *next += 1;
            let index = *next;
            let follower = tokio::spawn(Arc::clone(self).follow(m.clone(), index, channel.clone()));
            let segment = m.te_segment.clone();
            links.insert(
                m.node_id.clone(),
                Link { index, epoch: m.epoch, segment, channel, follower },
            );
        }
    }

    /// Keeps peer `m`'s inventory in the catalog under `index`, subscribing again after a
    /// pause whenever the stream breaks (its entries are dropped first).
    async fn follow(self: Arc<Self>, m: Member, index: u32, channel: Channel) {
        loop {
            self.cluster.update_peer(&m.node_id, |v| {
                *v = crate::PeerView { epoch: m.epoch, stream: "connecting".into(), ..v.clone() };
            });
            let why = match self.follow_once(&m, index, channel.clone()).await {
                Ok(()) => "ended by the owner".to_owned(),
                Err(e) => e.to_string(),
            };
            tracing::warn!(peer = %m.node_id, why = %why, "peer inventory stream broken; subscribing again");
            let n = Arc::clone(&self.cfg.node);
            blocking(move || n.catalog_drop(index)).await;
            self.cluster.update_peer(&m.node_id, |v| {
                v.stream = format!("error: {why}");
                v.catalog_entries = 0;
                v.complete = false;
            });
            tokio::time::sleep(RESUBSCRIBE_AFTER).await;
        }
    }

    async fn follow_once(
        &self,
        m: &Member,
        index: u32,
        channel: Channel,
    ) -> Result<(), StreamBroken> {
        let max = self.cfg.catalog_max_per_peer;
        let request = InventoryRequest {
            requester: self.cluster.cfg.node_id.clone(),
            requester_epoch: self.cluster.epoch().unwrap_or(0),
            max_entries: max as u64,
        };
        let mut stream = PeerClient::new(channel)
            .inventory(request)
            .await
            .map_err(StreamBroken::Rpc)?
            .into_inner();
        self.cluster.update_peer(&m.node_id, |v| v.stream = "snapshot".into());
        let mut held: HashSet<ChunkKey> = HashSet::new();
        let mut complete = true;
        while let Some(u) = stream.message().await.map_err(StreamBroken::Rpc)? {
            if u.owner_epoch != m.epoch {
                return Err(StreamBroken::Epoch { owner: u.owner_epoch, followed: m.epoch });
            }
            let mut added = Vec::with_capacity(u.added.len());
            for c in &u.added {
                let Some(key) = c.key.as_ref().and_then(Key::to_chunk_key) else { continue };
                if held.contains(&key) || held.len() < max {
                    held.insert(key);
                    added.push(InventoryChunk { key, len: c.len, checksum: c.checksum });
                } else {
                    // Over the bound: coverage is partial from here on.
                    complete = false;
                }
            }
            let removed: Vec<ChunkKey> =
                u.removed.iter().filter_map(Key::to_chunk_key).filter(|k| held.remove(k)).collect();
            if u.snapshot_end {
                complete &= u.complete;
            }
            if !added.is_empty() || !removed.is_empty() {
                let n = Arc::clone(&self.cfg.node);
                blocking(move || n.catalog_apply(index, added, removed)).await;
            }
            let entries = held.len() as u64;
            self.cluster.update_peer(&m.node_id, |v| {
                if u.snapshot_end {
                    v.stream = "live".into();
                }
                v.catalog_entries = entries;
                v.complete = complete;
            });
        }
        Ok(())
    }

    /// Groups `batch` by peer and starts each group's reads; fetches of peers not followed
    /// (any more) fail at once.
    async fn dispatch(self: &Arc<Self>, links: &HashMap<String, Link>, batch: Vec<PeerFetch>) {
        let mut groups: HashMap<u32, Vec<PeerFetch>> = HashMap::new();
        for f in batch {
            groups.entry(f.peer).or_default().push(f);
        }
        for (peer, fetches) in groups {
            match links.iter().find(|(_, l)| l.index == peer) {
                Some((node, l)) => {
                    for part in halves(fetches) {
                        let (node, epoch, channel) = (node.clone(), l.epoch, l.channel.clone());
                        tokio::spawn(Arc::clone(self).read(node, epoch, channel, part));
                    }
                }
                None => {
                    let n = Arc::clone(&self.cfg.node);
                    blocking(move || fetches.into_iter().for_each(|f| n.fetched(f, false))).await;
                }
            }
        }
    }

    /// Grant, read, release, hand back: one peer's group of fetches.
    async fn read(
        self: Arc<Self>,
        node: String,
        epoch: u64,
        channel: Channel,
        fetches: Vec<PeerFetch>,
    ) {
        let first = fetches.iter().map(|f| f.queued).min();
        let mut took = GroupTimes {
            queue: first.map_or(Duration::ZERO, |t| t.elapsed()),
            ..GroupTimes::default()
        };
        let read = match self.read_group(&node, epoch, channel, &fetches, &mut took).await {
            Ok(read) => read, // every fetch handed to its shard
            Err(e) => {
                tracing::warn!(peer = %node, chunks = fetches.len(), error = %e, "peer read failed: answered as misses");
                let read = vec![false; fetches.len()];
                let all: Vec<usize> = (0..fetches.len()).collect();
                self.hand(&fetches, &all, &read, &mut took).await;
                read
            }
        };
        let (ok, bytes) = fetches
            .iter()
            .zip(&read)
            .filter(|(_, r)| **r)
            .fold((0u64, 0u64), |(n, b), (f, _)| (n + 1, b + f.len));
        let failed = fetches.len() as u64 - ok;
        self.warm.touch();
        let handoff = took.handoff;
        tracing::debug!(
            peer = %node,
            chunks = ok,
            bytes,
            queue_us = took.queue.as_micros() as u64,
            grant_us = took.grant.as_micros() as u64,
            te_read_us = took.te_read.as_micros() as u64,
            handoff_us = handoff.as_micros() as u64,
            te_naps = took.te_naps,
            "group read"
        );
        self.cluster.update_peer(&node, |v| {
            v.chunks_read += ok;
            v.bytes_read += bytes;
            v.read_failures += failed;
            v.groups += 1;
            v.queue_ns += took.queue.as_nanos() as u64;
            v.grant_ns += took.grant.as_nanos() as u64;
            v.te_read_ns += took.te_read.as_nanos() as u64;
            v.handoff_ns += handoff.as_nanos() as u64;
        });
    }

    /// What a grant answer lets this node read: per fetch whether it is read, the TE ranges
    /// `(local, remote, len)` of those, and every grant id taken (to release).
    #[allow(clippy::type_complexity)]
    fn plan_reads(
        &self,
        fetches: &[PeerFetch],
        reply: &crate::rpc::GrantReply,
    ) -> Result<(Vec<bool>, Vec<(u64, u64, u64)>, Vec<u64>), String> {
        if reply.chunks.len() != fetches.len() {
            return Err(format!(
                "grant answered {} chunks for {}",
                reply.chunks.len(),
                fetches.len()
            ));
        }
        let mut read = vec![false; fetches.len()];
        let mut ranges = Vec::new();
        let mut ids = Vec::new();
        for (i, (f, g)) in fetches.iter().zip(&reply.chunks).enumerate() {
            if g.present {
                ids.push(g.grant_id);
                if g.len == f.len {
                    ranges.push((self.cfg.arena.0 + f.offset, g.addr, f.len));
                    read[i] = true;
                }
            }
        }
        Ok((read, ranges, ids))
    }

    async fn read_group(
        &self,
        node: &str,
        epoch: u64,
        channel: Channel,
        fetches: &[PeerFetch],
        took: &mut GroupTimes,
    ) -> Result<Vec<bool>, String> {
        let me = (self.cluster.cfg.node_id.clone(), self.cluster.epoch().unwrap_or(0));
        let mut client = PeerClient::new(channel);
        let request_id = self.next_request.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let releasing = ReleaseRequest {
            requester: me.0.clone(),
            requester_epoch: me.1,
            owner_epoch: epoch,
            grant_ids: Vec::new(),
            requests: vec![request_id],
        };
        let release = move |client: &mut PeerClient<Channel>| {
            let (mut client, release) = (client.clone(), releasing.clone());
            async move { tokio::time::timeout(CALL_TIMEOUT, client.release(release)).await }
        };
        let request = GrantRequest {
            requester: me.0.clone(),
            requester_epoch: me.1,
            owner_epoch: epoch,
            keys: fetches.iter().map(|f| (&f.key).into()).collect(),
            request_id,
        };
        let granting = Instant::now();
        let answer = tokio::time::timeout(CALL_TIMEOUT, client.grant(request));
        let reply = match hot(answer, HOT_FOR).await {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(s)) => return Err(format!("grant: {}", s.message())),
            Err(_) => {
                // The owner may still grant: cancel, so that what it takes goes back.
                let _ = release(&mut client).await;
                return Err("grant timed out (cancelled)".to_owned());
            }
        };
        took.grant = granting.elapsed();
        let (read, ranges, ids) = match self.plan_reads(fetches, &reply) {
            Ok(plan) => plan,
            Err(e) => {
                // A malformed answer: what it may have granted goes back.
                let _ = release(&mut client).await;
                return Err(e);
            }
        };
        self.cluster.update_peer(node, |v| v.grants_held += ids.len() as u64);
        // The chunks go to the shards as they land (TE says which have), so a shard checks the
        // checksums of those while the rest are on the wire.
        let with_range: Vec<usize> = (0..fetches.len()).filter(|&i| read[i]).collect();
        let in_order: Vec<PeerFetch> = with_range.iter().map(|&i| fetches[i]).collect();
        let reading = Instant::now();
        let (moved, handed) = self.te_read(&reply.segment, ranges, in_order, took).await;
        took.te_read += reading.elapsed();
        let mut landed = vec![false; fetches.len()];
        with_range[..handed].iter().for_each(|&i| landed[i] = true);
        let failure = moved.err();
        // What did not land (the read failed): misses.
        self.hand(fetches, &with_range[handed..], &landed, took).await;
        // Fetches the owner did not grant (gone, or another length): misses.
        let refused: Vec<usize> = (0..fetches.len()).filter(|&i| !read[i]).collect();
        self.hand(fetches, &refused, &landed, took).await;
        // The reads are over (done or failed): the grants go back, while the shards already
        // take the chunks.
        let held = ids.len() as u64;
        let (cluster, owner) = (Arc::clone(&self.cluster), node.to_owned());
        tokio::spawn(async move {
            // A release refused or lost is sent again: until the owner has it, it keeps the
            // leases (it would return them only once this node is gone).
            for attempt in 1..=RELEASE_TRIES {
                let why = match release(&mut client).await {
                    Ok(Ok(_)) => break,
                    Ok(Err(status)) => status.message().to_owned(),
                    Err(_) => "timed out".to_owned(),
                };
                if attempt == RELEASE_TRIES {
                    tracing::warn!(peer = %owner, grants = held, error = %why, "releasing grants failed; the owner returns them once this node is gone");
                } else {
                    tokio::time::sleep(RELEASE_RETRY_AFTER * attempt).await;
                }
            }
            cluster.update_peer(&owner, |v| v.grants_held = v.grants_held.saturating_sub(held));
        });
        if let Some(e) = failure {
            tracing::warn!(peer = %node, chunks = fetches.len(), error = %e, "peer read failed: what was not read is answered as misses");
        }
        Ok(landed)
    }

    /// Reads `ranges` of `segment` (the ranges of `in_order`'s fetches, in order), handing
    /// each fetch to its shard as its chunk lands: the outcome, and how many (from the first)
    /// were handed as read.
    async fn te_read(
        &self,
        segment: &str,
        ranges: Vec<(u64, u64, u64)>,
        in_order: Vec<PeerFetch>,
        took: &mut GroupTimes,
    ) -> (Result<(), String>, usize) {
        // Tests: a read that fails (`return`) or crawls first (`sleep(ms)`).
        #[cfg(feature = "failpoints")]
        {
            let fail = tokio::task::spawn_blocking(|| {
                fail::fail_point!("peer-te-read", |_| true);
                false
            });
            if fail.await.unwrap_or(false) {
                return (Err("failpoint peer-te-read".to_owned()), 0);
            }
        }
        if ranges.is_empty() {
            // Nothing was granted: nothing to read.
            return (Ok(()), 0);
        }
        match &self.te {
            Engine::C(te) => {
                // On this runtime: TE moves the bytes on its own threads, and polling them
                // here hands each landed chunk on at once, with no thread to wake.
                if !te.is_open(segment) {
                    let (te, peer) = (Arc::clone(te), segment.to_owned());
                    let opened = tokio::task::spawn_blocking(move || te.open_segment(&peer));
                    if let Err(e) = opened.await.expect("opening a segment does not panic") {
                        return (Err(e.to_string()), 0);
                    }
                }
                let mut t = match te.start_read(segment, &ranges) {
                    Ok(t) => t,
                    Err(e) => return (Err(e.to_string()), 0),
                };
                let (mut handed, mut ended, mut progress) = (0, 0, Instant::now());
                // `hand` takes indices: these, in order, all read.
                let (order, all): (Vec<usize>, Vec<bool>) =
                    (0..in_order.len()).map(|i| (i, true)).unzip();
                let hot_for = if self.warm.polls() { READ_POLL_HOT } else { POLL_HOT };
                loop {
                    let over = t.poll();
                    if t.landed() > handed {
                        self.hand(&in_order, &order[handed..t.landed()], &all, took).await;
                        handed = t.landed();
                    }
                    if let Some(result) = over {
                        return (result.map_err(|e| e.to_string()), handed);
                    }
                    if t.ended() > ended {
                        (ended, progress) = (t.ended(), Instant::now());
                    }
                    // Polled without sleeping for a while after each transfer ends (the whole
                    // read, when this thread has a core of its own), then on the runtime's
                    // timer (1 ms apart: a slow read).
                    if progress.elapsed() < hot_for {
                        tokio::task::yield_now().await;
                    } else {
                        took.te_naps += 1;
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            }
            #[cfg(feature = "te-python")]
            Engine::Python(te) => {
                let (te, segment) = (Arc::clone(te), segment.to_owned());
                let local = Arc::clone(&self.cfg.node);
                let job = tokio::task::spawn_blocking(move || {
                    let (mut handed, mut handoff) = (0, Duration::ZERO);
                    let moved = te.read_streaming(&segment, &ranges, &mut |n| {
                        let handing = Instant::now();
                        for &f in &in_order[handed..n] {
                            if !local.fetched_now(f, true) {
                                local.fetched(f, true);
                            }
                        }
                        handed = n;
                        handoff += handing.elapsed();
                    });
                    (moved.map_err(|e| e.to_string()), handed, handoff)
                });
                let (moved, handed, handoff) =
                    job.await.expect("Transfer Engine reads do not panic");
                took.handoff += handoff;
                (moved, handed)
            }
        }
    }

    /// Hands fetches `which` of `fetches` to their shards, read or not as `landed` says.
    async fn hand(
        &self,
        fetches: &[PeerFetch],
        which: &[usize],
        landed: &[bool],
        took: &mut GroupTimes,
    ) {
        if which.is_empty() {
            return;
        }
        let handing = Instant::now();
        // Straight into the shards' queues where they have room; the rest waits for room on
        // the blocking pool.
        let n = &self.cfg.node;
        let items: Vec<(PeerFetch, bool)> = which
            .iter()
            .map(|&i| (fetches[i], landed[i]))
            .filter(|&(f, r)| !n.fetched_now(f, r))
            .collect();
        if !items.is_empty() {
            let n = Arc::clone(n);
            blocking(move || items.into_iter().for_each(|(f, r)| n.fetched(f, r))).await;
        }
        took.handoff += handing.elapsed();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fetches(lens: &[u64]) -> Vec<PeerFetch> {
        lens.iter()
            .enumerate()
            .map(|(i, &len)| PeerFetch {
                shard: 0,
                key: ChunkKey::new(1, [i as u8; 32]),
                peer: 1,
                offset: i as u64 * (8 << 20),
                len,
                generation: 1,
                queued: Instant::now(),
            })
            .collect()
    }

    fn lens(parts: &[Vec<PeerFetch>]) -> Vec<Vec<u64>> {
        parts.iter().map(|p| p.iter().map(|f| f.len).collect()).collect()
    }

    #[test]
    fn large_groups_are_read_as_two_halves_of_about_equal_bytes() {
        const M: u64 = 1 << 20;
        const Q: u64 = 4 * M;
        // Under the threshold, or a single chunk: one group.
        assert_eq!(lens(&halves(fetches(&[Q, Q, Q]))), vec![vec![Q, Q, Q]]);
        assert_eq!(lens(&halves(fetches(&[64 * M]))), vec![vec![64 * M]]);
        // At it: halves, in order, nothing lost.
        assert_eq!(lens(&halves(fetches(&[Q; 4]))), vec![vec![Q, Q], vec![Q, Q]]);
        assert_eq!(lens(&halves(fetches(&[Q; 5]))), vec![vec![Q, Q, Q], vec![Q, Q]]);
        // Unequal chunks: cut where the first half reaches half the bytes.
        assert_eq!(lens(&halves(fetches(&[8 * Q, Q, Q]))), vec![vec![8 * Q], vec![Q, Q]]);
        assert_eq!(lens(&halves(fetches(&[Q, Q, 8 * Q]))), vec![vec![Q, Q], vec![8 * Q]]);
        let all = halves(fetches(&[M; 33]));
        let keys: Vec<u8> = all.iter().flatten().map(|f| f.key.digest[0]).collect();
        assert_eq!(keys, (0..33).collect::<Vec<u8>>());
    }
}
