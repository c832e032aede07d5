//! Tensor-parallel groups: the ranks of one model instance store their shards of the KV cache
//! under rank-specific namespaces (the descriptor's `tp_rank`), so a prefix is reusable only
//! as far as every rank has it. A fast rank's prefix is not the group's.

use orbitkv_proto::ChunkKey;

use crate::{Client, Error};

/// What a tensor-parallel group has cached of a prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupPrefix {
    /// Chunks present for every rank: the prefix the group can load.
    pub chunks: usize,
    /// Chunks present for each rank, in rank order; a rank is asked only about the prefix the
    /// ranks before it have, so its count stops there.
    pub per_rank: Vec<usize>,
}

impl Client {
    /// The longest prefix present for every rank of a tensor-parallel group: `ranks[r]` are
    /// rank `r`'s chunk keys of the same prompt (same count for every rank, one namespace per
    /// rank, no two ranks in one namespace). Nothing is leased: the answer is a snapshot, and
    /// each rank's load leases (and reports) what it actually gets.
    pub fn lookup_group(&mut self, ranks: &[&[ChunkKey]]) -> Result<GroupPrefix, Error> {
        let Some(first) = ranks.first() else {
            return Err(Error::InvalidArgument("a group has at least one rank".into()));
        };
        let mut namespaces = Vec::with_capacity(ranks.len());
        for (r, keys) in ranks.iter().enumerate() {
            if keys.len() != first.len() {
                return Err(Error::InvalidArgument(format!(
                    "rank {r} has {} keys, rank 0 has {}: every rank names the same chunks",
                    keys.len(),
                    first.len()
                )));
            }
            let Some(ns) = keys.first().map(|k| k.namespace) else { continue };
            if keys.iter().any(|k| k.namespace != ns) {
                return Err(Error::InvalidArgument(format!(
                    "rank {r}'s keys span several namespaces: one namespace per rank"
                )));
            }
            if let Some(other) = namespaces.iter().position(|&n| n == ns) {
                return Err(Error::InvalidArgument(format!(
                    "ranks {other} and {r} use the same namespace {ns:#x}: each rank has its own \
                     (tp_rank in the descriptor)"
                )));
            }
            namespaces.push(ns);
        }
        let mut per_rank = Vec::with_capacity(ranks.len());
        let mut chunks = first.len();
        for keys in ranks {
            // Only the group's prefix so far can still count: ask for no more.
            let present = self.lookup(&keys[..chunks])?.len();
            chunks = chunks.min(present);
            per_rank.push(present);
        }
        Ok(GroupPrefix { chunks, per_rank })
    }
}
