//! Moving engine KV pages between GPU memory and the arena: copy plans ([`plan`]), the copy
//! engine of one device ([`CopyEngine`]) and the CUDA calls behind it.

pub mod checksum;
mod engine;
mod ffi;
mod hasher;
mod memory;
pub mod plan;
mod timeline;

pub use engine::{BatchSpan, CopyEngine, Direction, JobShape};
pub use ffi::DeviceBuffer;
pub use hasher::{ChecksumTicket, ChunkHasher};
pub use memory::{EngineMemory, TensorExport};
pub use timeline::SpanTotals;

/// Pieces at least this long go batched under [`Strategy::Auto`]: measured on the H200 host
/// (docs/performance.md), `cuMemcpyBatchAsync` matched the staging pipeline only for pieces of
/// a megabyte or more (cross-layer blocks), and it uses no SM; below, staging wins (at 32 KiB
/// 0.92-0.95 of the ceiling batched against 0.96-0.98 staged, at 2 KiB 0.07 against 0.88).
pub const BATCHED_FROM: u64 = 1 << 20;

/// Bytes of chunks in one DMA job: the server splits saves and loads into jobs of at most
/// this many bytes (whole chunks, at least one), so that a save's first commits overlap its
/// later copies.
pub const JOB_BYTES: u64 = 64 << 20;

/// The first jobs of a request are this fraction of [`JOB_BYTES`], in turn (then whole ones).
const RAMP: [u64; 3] = [8, 4, 2];

/// The jobs a request of `chunks` chunks of `chunk_len` bytes is split into, as ranges of its
/// chunk indices in order: at most [`JOB_BYTES`] each (at least one chunk), the first three an
/// eighth, a quarter and a half of that. A job's pieces are planned on the DMA thread before
/// its first copy can start, and planning a 64 MiB job of 2 KiB pages (32,768 pieces) takes
/// hundreds of microseconds; a small first job starts the copy engine sooner, and each later
/// job, twice the one before, is planned while that one copies (planning runs several times
/// faster than the bus).
pub fn job_groups(chunks: usize, chunk_len: u64) -> Vec<std::ops::Range<usize>> {
    let full = (JOB_BYTES / chunk_len.max(1)).max(1);
    let mut out = Vec::new();
    let mut from = 0;
    let mut k = 0;
    while from < chunks {
        let n = RAMP.get(k).map_or(full, |part| (full / part).max(1));
        let to = chunks.min(from + n as usize);
        out.push(from..to);
        from = to;
        k += 1;
    }
    out
}

/// How pieces cross the bus.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Gather/scatter kernel into a GPU staging buffer, contiguous DMA.
    Staged,
    /// `cuMemcpyBatchAsync` per piece (copy engines only).
    Batched,
    /// Staged for small pieces, batched for large ones.
    Auto,
    /// The segment kernel alone, straight between engine pages and the arena through its
    /// device mapping: no staging, no copy engine; SMs move the bytes over the bus. An
    /// experiment (`orbitkv-perf dma --strategy direct`, `--gpu-copy direct`); the engine
    /// needs [`CopyEngine::set_host_mapping`](crate::dma::CopyEngine::set_host_mapping).
    Direct,
}

impl Strategy {
    /// The name `parse` reads.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Staged => "staged",
            Self::Batched => "batched",
            Self::Auto => "auto",
            Self::Direct => "direct",
        }
    }

    /// Parses `staged`, `batched`, `auto` or `direct`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "staged" => Some(Self::Staged),
            "batched" => Some(Self::Batched),
            "auto" => Some(Self::Auto),
            "direct" => Some(Self::Direct),
            _ => None,
        }
    }
}

/// Failures of the DMA path.
#[derive(Debug, thiserror::Error)]
pub enum DmaError {
    /// A CUDA driver call failed.
    #[error("CUDA {op} failed: {detail}")]
    Cuda {
        /// The call.
        op: &'static str,
        /// The driver's error.
        detail: String,
    },
    /// A request that cannot be carried out as given.
    #[error("invalid DMA request: {0}")]
    Invalid(String),
}

#[cfg(test)]
mod tests {
    use super::{job_groups, Strategy, JOB_BYTES};

    #[test]
    fn jobs_ramp_up_to_job_bytes() {
        let mib = 1u64 << 20;
        // 2 MiB chunks: 32 per whole job; 4, 8, 16, then 32 at a time.
        let g = job_groups(100, 2 * mib);
        assert_eq!(g, vec![0..4, 4..12, 12..28, 28..60, 60..92, 92..100]);
        // Every chunk once, in order, none past JOB_BYTES.
        for (chunks, len) in [(1, 2 * mib), (7, 512 << 10), (1000, 18 << 10), (5, 100 * mib)] {
            let g = job_groups(chunks, len);
            assert_eq!(g.first().map(|r| r.start), Some(0));
            assert_eq!(g.last().map(|r| r.end), Some(chunks));
            assert!(g.windows(2).all(|w| w[0].end == w[1].start), "{g:?}");
            assert!(g.iter().all(|r| !r.is_empty()), "{g:?}");
            assert!(
                g.iter().all(|r| r.len() as u64 * len <= JOB_BYTES.max(len)),
                "{chunks} x {len}: {g:?}"
            );
        }
        // Chunks of half a job or more: one or two per job from the start.
        assert_eq!(job_groups(5, 40 * mib), vec![0..1, 1..2, 2..3, 3..4, 4..5]);
        assert_eq!(job_groups(5, 32 * mib), vec![0..1, 1..2, 2..3, 3..5]);
        assert!(job_groups(0, 2 * mib).is_empty());
    }

    #[test]
    fn strategy_names_round_trip() {
        for s in [Strategy::Auto, Strategy::Staged, Strategy::Batched, Strategy::Direct] {
            assert_eq!(Strategy::parse(s.as_str()), Some(s));
        }
        assert_eq!(Strategy::parse("fast"), None);
    }
}
