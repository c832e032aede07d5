//! Fan-out: a request's keys split by their shards, one op per shard (the remote ones over
//! the mesh, at once), the replies put back in key order. What the request handlers
//! (`router`, `transfer`) share.

use std::rc::Rc;

use orbitkv_proto::{ChunkKey, ChunkOutcome, ErrorCode, Hit, Reservation, SlotRef};
use orbitkv_shards::{SessionId, ShardOp, ShardReply};

use crate::shard::context::Exec;

/// Looks `keys` up on their shards (leasing the hits when `lease`); one result per key, in
/// key order (hits past a miss included).
pub(crate) async fn lookup(
    exec: &Rc<Exec>,
    session: SessionId,
    keys: &[ChunkKey],
    lease: bool,
) -> Vec<Option<Hit>> {
    scatter(
        exec,
        keys,
        |k| k,
        |keys| ShardOp::Lookup { session, keys, lease },
        |r| match r {
            ShardReply::Hits(h) => Some(h),
            _ => None,
        },
        None,
    )
    .await
}

/// Reserves `(key, length)` items on their shards for `session`; one result per item.
pub(crate) async fn reserve(
    exec: &Rc<Exec>,
    session: SessionId,
    items: &[(ChunkKey, u64)],
) -> Vec<Reservation> {
    scatter(
        exec,
        items,
        |(k, _)| k,
        |items| {
            let (keys, lens) = items.into_iter().unzip();
            ShardOp::Reserve { session, keys, lens }
        },
        |r| match r {
            ShardReply::Reserved(s) => Some(s),
            _ => None,
        },
        Reservation::Failed(ErrorCode::Internal),
    )
    .await
}

/// What happens to the other slots of a commit whose checked checksum was wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnWrongChecksum {
    /// Abort them (`ChecksumMismatch`): their checksums came from the same wrong source.
    AbortRest,
    /// Commit them with checksums their shards compute.
    HashRest,
}

/// Which of a commit's given checksums its shards check against the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Check {
    /// Every one.
    All,
    /// The first, before the others are committed.
    First,
    /// None: taken as given (a spot check of the same writer's checksums ran elsewhere).
    Nothing,
}

/// Commits `refs` with checksums computed by their writer (`sums[i]` for `refs[i]`), checking
/// those `check` names against their bytes on their shards; a wrong one answers
/// `ChecksumMismatch`, is not stored, and the others go as `on_wrong` says. Unchecked
/// checksums are taken as given.
pub(crate) async fn commit_given(
    exec: &Rc<Exec>,
    session: SessionId,
    refs: &[SlotRef],
    sums: &[u64],
    check: Check,
    on_wrong: OnWrongChecksum,
) -> Vec<ChunkOutcome> {
    let verify_all = check == Check::All;
    let items: Vec<(SlotRef, u64, bool)> = refs
        .iter()
        .zip(sums)
        .enumerate()
        .map(|(k, (r, s))| (*r, *s, verify_all || (check == Check::First && k == 0)))
        .collect();
    let commit = |items: &[(SlotRef, u64, bool)]| {
        let items = items.to_vec();
        let exec = Rc::clone(exec);
        async move {
            scatter(
                &exec,
                &items,
                |x| &x.0.key,
                |slots| ShardOp::CommitSummed { session, slots },
                outcomes,
                FAILED,
            )
            .await
        }
    };
    if check != Check::First || items.len() <= 1 {
        return commit(&items).await;
    }
    let mut out = commit(&items[..1]).await;
    if out[0] == ChunkOutcome::Failed(ErrorCode::ChecksumMismatch) {
        let rest = &refs[1..];
        out.extend(match on_wrong {
            OnWrongChecksum::AbortRest => {
                per_slot(exec, rest, |slots| ShardOp::Abort { session, slots }).await;
                vec![ChunkOutcome::Failed(ErrorCode::ChecksumMismatch); rest.len()]
            }
            OnWrongChecksum::HashRest => {
                per_slot(exec, rest, |slots| ShardOp::Commit { session, slots }).await
            }
        });
        return out;
    }
    out.extend(commit(&items[1..]).await);
    out
}

/// The outcome of an item whose shard reply was lost.
pub(crate) const FAILED: ChunkOutcome = ChunkOutcome::Failed(ErrorCode::Internal);

/// Runs a per-slot op (commit, abort, release) on the slots' shards.
pub(crate) async fn per_slot(
    exec: &Rc<Exec>,
    slots: &[SlotRef],
    make_op: impl Fn(Vec<SlotRef>) -> ShardOp,
) -> Vec<ChunkOutcome> {
    scatter(exec, slots, |s| &s.key, make_op, outcomes, FAILED).await
}

pub(crate) fn outcomes(r: ShardReply) -> Option<Vec<ChunkOutcome>> {
    match r {
        ShardReply::Outcomes(o) => Some(o),
        _ => None,
    }
}

/// Splits `items` by owning shard, runs one op per shard (remote ones concurrently), and
/// returns the per-item results in item order. A shard whose reply is lost or malformed
/// yields `fallback` for its items.
pub(crate) async fn scatter<T: Clone, R: Clone + 'static>(
    exec: &Rc<Exec>,
    items: &[T],
    key: impl Fn(&T) -> &ChunkKey,
    make_op: impl Fn(Vec<T>) -> ShardOp,
    unpack: impl Fn(ShardReply) -> Option<Vec<R>>,
    fallback: R,
) -> Vec<R> {
    let shards = exec.shards;
    let mut positions: Vec<Vec<usize>> = vec![Vec::new(); shards];
    for (i, item) in items.iter().enumerate() {
        positions[key(item).shard(shards)].push(i);
    }
    // Remote ops leave first, so the other shards work while this one does its own part;
    // no task per shard: the replies are awaited in place below.
    let mut remote = Vec::new();
    let mut local = None;
    for (shard, pos) in positions.iter().enumerate() {
        if pos.is_empty() {
            continue;
        }
        let op = make_op(pos.iter().map(|&i| items[i].clone()).collect());
        if shard == exec.id {
            local = Some((shard, op));
        } else {
            remote.push((shard, exec.send_remote(shard, op).await));
        }
    }
    let mut out = vec![fallback.clone(); items.len()];
    let mut place = |shard: usize, reply: ShardReply| match unpack(reply) {
        Some(results) if results.len() == positions[shard].len() => {
            for (&i, r) in positions[shard].iter().zip(results) {
                out[i] = r;
            }
        }
        _ => tracing::error!(shard, "shard reply lost or of the wrong shape"),
    };
    if let Some((shard, op)) = local {
        let reply = exec.exec_on(shard, op).await;
        place(shard, reply);
    }
    for (shard, sent) in remote {
        place(shard, Exec::remote_reply(sent).await);
    }
    out
}
