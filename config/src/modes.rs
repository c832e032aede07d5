//! The flag values that the GPU and cluster crates act on, defined here with the options
//! that name them (each one's `as_str` is its flag spelling; clap and serde read the same).

/// Whether the server uses CUDA.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum GpuMode {
    /// Use CUDA when a device is present; otherwise serve DRAM/SSD only.
    #[default]
    Auto,
    /// Never touch CUDA.
    Off,
    /// Refuse to start without a usable CUDA device.
    Required,
}

impl GpuMode {
    /// Parses `auto`, `off` or `required`.
    pub fn parse(s: &str) -> Option<GpuMode> {
        match s {
            "auto" => Some(GpuMode::Auto),
            "off" => Some(GpuMode::Off),
            "required" => Some(GpuMode::Required),
            _ => None,
        }
    }

    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            GpuMode::Auto => "auto",
            GpuMode::Off => "off",
            GpuMode::Required => "required",
        }
    }
}

/// How pieces cross the bus.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Gather/scatter kernel into a GPU staging buffer, contiguous DMA.
    Staged,
    /// `cuMemcpyBatchAsync` per piece (copy engines only).
    Batched,
    /// Staged for small pieces, batched for large ones; a save whose gather sums its rows
    /// (the fused checksums) staged whatever its pieces' length.
    Auto,
}

impl Strategy {
    /// The name `parse` reads.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Staged => "staged",
            Self::Batched => "batched",
            Self::Auto => "auto",
        }
    }

    /// Parses `staged`, `batched` or `auto`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "staged" => Some(Self::Staged),
            "batched" => Some(Self::Batched),
            "auto" => Some(Self::Auto),
            _ => None,
        }
    }
}

/// Bytes of chunks in one DMA job by default: the server splits saves and loads into jobs of
/// at most this many bytes (whole chunks, at least one; `--gpu-job` sets it), so that a
/// save's first commits overlap its later copies.
pub const JOB_BYTES: u64 = 64 << 20;

/// The parts a GPU staging buffer may be cut into (`--gpu-staging-depth`).
pub const STAGING_DEPTHS: std::ops::RangeInclusive<usize> = 2..=8;

/// The parts a staging of `staging_bytes` is cut into when none is asked for: as many as
/// it holds jobs of `job_bytes` (up to eight, at least two), so that a part holds a whole
/// job rather than leaving half of itself unused behind one.
pub fn default_staging_depth(staging_bytes: u64, job_bytes: u64) -> usize {
    usize::try_from(staging_bytes / job_bytes.max(1))
        .unwrap_or(usize::MAX)
        .clamp(*STAGING_DEPTHS.start(), *STAGING_DEPTHS.end())
}

/// The transports an engine moves bytes with (`--te-transport`).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum TeTransport {
    /// TE's own choice from the host's devices (its topology discovery): its RDMA transport
    /// over the RDMA devices it finds, TCP on a host without any.
    #[default]
    Auto,
    /// TCP only, whatever devices the host has.
    Tcp,
}

impl TeTransport {
    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            TeTransport::Auto => "auto",
            TeTransport::Tcp => "tcp",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Strategy;

    #[test]
    fn strategy_names_round_trip() {
        for s in [Strategy::Auto, Strategy::Staged, Strategy::Batched] {
            assert_eq!(Strategy::parse(s.as_str()), Some(s));
            assert_eq!(<Strategy as clap::ValueEnum>::from_str(s.as_str(), false), Ok(s));
        }
        assert_eq!(Strategy::parse("fast"), None);
        assert_eq!(Strategy::parse("direct"), None, "an experiment that lost");
    }
}
