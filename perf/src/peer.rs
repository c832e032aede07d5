//! `orbitkv-perf peer`: cluster peer reads. Chunks are put on the owner; the requester, a
//! Manager of the same cluster, is asked for them and reads them from the owner with Mooncake
//! Transfer Engine (grant, TE read into a local slot, checksum check, release): what an engine
//! on the requester's host sees as a remote get. The baseline is raw Transfer Engine reads of
//! the same bytes in the same batches between two engines of this process over loopback TCP,
//! alternating with the remote reads batch by batch (both see the same moments of a shared
//! host). Both Managers must run on this host (their sockets are local).
//!
//! Measured: remote get GB/s over `--chunks` chunks read `--batch` per lookup (each lookup
//! timed from request to answer: the chunks are in the requester's arena when it returns), and
//! the lookup-to-first-byte latency of single-chunk lookups. Every chunk read is verified.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use orbitkv_client::{ChunkKey, Client, ClientOptions, Dtype, NamespaceDescriptor, Tier};
use serde::Serialize;

use crate::admin;
use crate::args::PeerArgs;
use crate::error::{invalid, Error};
use crate::stats::Latency;

/// Bytes per token of the benchmark namespace (fp32, one layer, one head of 512, K and V).
const TOKEN_BYTES: u64 = 4096;
/// Longest wait for the requester's catalog to list the chunks put on the owner.
const CATALOG_WAIT: Duration = Duration::from_secs(60);
/// Largest batch in bytes (each side of the raw baseline holds one).
const MAX_BATCH_BYTES: u64 = 1 << 30;

/// Latency quantiles in microseconds.
#[derive(Debug, Default, Serialize)]
pub(crate) struct Quantiles {
    pub samples: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

impl From<&Latency> for Quantiles {
    fn from(l: &Latency) -> Self {
        Quantiles {
            samples: l.count(),
            p50_us: l.quantile_us(0.5),
            p99_us: l.quantile_us(0.99),
            max_us: l.max_us(),
        }
    }
}

/// The result of `peer`.
#[derive(Debug, Serialize)]
pub(crate) struct PeerReport {
    /// Node ids.
    pub owner: String,
    pub requester: String,
    pub chunk_bytes: u64,
    /// Chunks in the throughput part, and per lookup.
    pub chunks: u64,
    pub batch: u64,
    /// Remote gets through the requester.
    pub remote_gbps: f64,
    /// Raw Transfer Engine reads of the same bytes in the same batches.
    pub te_gbps: f64,
    /// `remote_gbps / te_gbps`.
    pub ratio: f64,
    /// Per lookup, the raw read's time of the same bytes (the batch after it) over the
    /// lookup's: its quantiles (10th, 50th, 90th percentile), less moved by a stall of the
    /// host in one batch than `ratio` is.
    pub paired_ratio: [f64; 3],
    /// Median time of one lookup, and of one raw read of the same bytes, in microseconds.
    pub lookup_us_p50: f64,
    pub te_batch_us_p50: f64,
    /// Single-chunk lookups on the requester, request to answer (bytes local).
    pub first_byte: Quantiles,
    /// Single-chunk raw Transfer Engine reads.
    pub te_first_byte: Quantiles,
    /// Chunks whose bytes were checked, and of those, wrong ones.
    pub verified_chunks: u64,
    pub wrong_chunks: u64,
    /// Chunks the requester did not find at the owner (not a peer hit).
    pub missed_chunks: u64,
}

impl crate::report::Report for PeerReport {
    fn write_table(&self, out: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            out,
            "peer reads: owner {} -> requester {}, {} chunks of {}, {} per lookup",
            self.owner,
            self.requester,
            self.chunks,
            orbitkv_proto::format_bytes(self.chunk_bytes),
            self.batch
        )?;
        writeln!(out, "{:<26} {:>8}", "", "GB/s")?;
        writeln!(out, "{:<26} {:>8.2}", "remote get (requester)", self.remote_gbps)?;
        writeln!(out, "{:<26} {:>8.2}", "raw Transfer Engine read", self.te_gbps)?;
        writeln!(out, "{:<26} {:>8.2}", "ratio", self.ratio)?;
        let [p10, p50, p90] = self.paired_ratio;
        writeln!(
            out,
            "per lookup: ratio p10 {p10:.2}  p50 {p50:.2}  p90 {p90:.2}; lookup p50 {:.0}us, raw read p50 {:.0}us",
            self.lookup_us_p50, self.te_batch_us_p50
        )?;
        let q = |q: &Quantiles| {
            format!("p50 {:.0}us  p99 {:.0}us  max {:.0}us", q.p50_us, q.p99_us, q.max_us)
        };
        writeln!(
            out,
            "lookup to first byte, 1 chunk ({} samples): {}",
            self.first_byte.samples,
            q(&self.first_byte)
        )?;
        writeln!(out, "raw Transfer Engine read, 1 chunk: {}", q(&self.te_first_byte))?;
        writeln!(
            out,
            "verified {} chunks: {} wrong, {} not found at the owner",
            self.verified_chunks, self.wrong_chunks, self.missed_chunks
        )
    }

    fn passed(&self) -> bool {
        self.wrong_chunks == 0 && self.missed_chunks == 0
    }
}

/// Checks the flags before anything connects.
fn check(a: &PeerArgs) -> Result<(), Error> {
    if a.chunk_size < TOKEN_BYTES
        || a.chunk_size > 16 << 20
        || !a.chunk_size.is_multiple_of(TOKEN_BYTES)
    {
        return Err(invalid("--chunk-size", "must be a multiple of 4 KiB from 4KiB to 16MiB"));
    }
    if a.chunks == 0 || a.chunks > 65_536 {
        return Err(invalid("--chunks", format!("must be 1 to 65536, not {}", a.chunks)));
    }
    if a.te_library.is_none() && a.te_transport != orbitkv_peer::TeTransport::Auto {
        return Err(invalid(
            "--te-transport",
            "chooses the transports of --te-library engines: give --te-library too",
        ));
    }
    if a.batch == 0 || a.batch > 1024 {
        return Err(invalid("--batch", format!("must be 1 to 1024, not {}", a.batch)));
    }
    if a.batch as u64 * a.chunk_size > MAX_BATCH_BYTES {
        return Err(invalid("--batch", "a batch must hold at most 1 GiB (--batch x --chunk-size)"));
    }
    if a.latency_samples > 10_000 {
        return Err(invalid("--latency-samples", "must be 0 to 10000"));
    }
    Ok(())
}

/// The deterministic bytes of chunk `i` of run `seed`.
fn fill(seed: u64, i: u64, out: &mut [u8]) {
    let mut x = (seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
    for word in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        word.copy_from_slice(&x.to_le_bytes()[..word.len()]);
    }
}

fn namespace(chunk_size: u64) -> NamespaceDescriptor {
    NamespaceDescriptor {
        model: "orbitkv-perf/peer".into(),
        dtype: Dtype::Fp32,
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 512,
        kv_tensors: 2,
        tokens_per_chunk: (chunk_size / TOKEN_BYTES) as u32,
        layout_version: 1,
        tp_rank: 0,
        tp_world_size: 1,
    }
}

fn connect(socket: &Path, name: &str, client: usize) -> Result<Client, Error> {
    Client::connect(ClientOptions { name: name.into(), ..ClientOptions::with_socket(socket) })
        .map_err(|source| Error::Client { client, source })
}

/// The node id of the Manager at `socket`, checking that it peers.
fn node_of(socket: &Path, flag: &'static str) -> Result<(String, String), Error> {
    let v = admin::client(socket)
        .peers()
        .map_err(|e| invalid(flag, format!("not a cluster member: {e}")))?;
    if !v.peering {
        return Err(invalid(
            flag,
            "its Manager is in a cluster but does not peer (no Transfer Engine)",
        ));
    }
    Ok((v.cluster.node_id, v.cluster.cluster))
}

/// Catalog entries of `owner` on the requester at `socket`.
fn catalog_of(socket: &Path, owner: &str) -> Result<u64, Error> {
    let v = admin::client(socket).peers()?;
    Ok(v.peers.get(owner).map_or(0, |p| p.catalog_entries))
}

/// Puts this run's chunks on the owner (keys of this run only: none is on the requester yet)
/// and waits until the requester's catalog lists them: the seed of their bytes, and the keys.
fn put_chunks(
    a: &PeerArgs,
    put: &mut Client,
    ns: &NamespaceDescriptor,
    (owner, requester): (&str, &str),
) -> Result<(u64, Vec<ChunkKey>), Error> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        ^ std::process::id() as u64;
    let total = a.latency_samples as u64 + a.chunks as u64;
    let tokens: Vec<u32> = (0..total * ns.tokens_per_chunk as u64)
        .map(|t| (t as u32).wrapping_mul(2_654_435_761) ^ seed as u32)
        .collect();
    let keys: Vec<ChunkKey> =
        orbitkv_client::prefix_digests(&tokens, ns.tokens_per_chunk as usize, &seed.to_le_bytes())
            .into_iter()
            .map(|d| ChunkKey::new(ns.id(), d))
            .collect();
    let before = catalog_of(&a.requester, owner)?;
    let mut value = vec![0u8; a.chunk_size as usize];
    for (i, part) in keys.chunks(a.batch as usize).enumerate() {
        let values: Vec<Vec<u8>> = (0..part.len())
            .map(|j| {
                fill(seed, (i * a.batch as usize + j) as u64, &mut value);
                value.clone()
            })
            .collect();
        let items: Vec<(ChunkKey, &[u8])> =
            part.iter().zip(&values).map(|(k, v)| (*k, v.as_slice())).collect();
        put.put(&items).map_err(|source| Error::Client { client: 0, source })?;
    }
    let deadline = Instant::now() + CATALOG_WAIT;
    while catalog_of(&a.requester, owner)? < before + total {
        if Instant::now() > deadline {
            return Err(Error::Setup(format!(
                "{requester}'s catalog of {owner} did not grow by {total} entries in {CATALOG_WAIT:?} \
                 (is --peer-catalog-entries on the requester large enough?)"
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }

    Ok((seed, keys))
}

/// Runs the benchmark.
pub(crate) fn run(a: &PeerArgs) -> Result<PeerReport, Error> {
    check(a)?;
    let raw = te::Baseline::new(a)?;
    let (owner, cluster) = node_of(&a.owner, "--owner")?;
    let (requester, other) = node_of(&a.requester, "--requester")?;
    if cluster != other || owner == requester {
        return Err(invalid(
            "--requester",
            format!("{requester} of cluster {other:?} is not another member of {owner}'s cluster {cluster:?}"),
        ));
    }
    let ns = namespace(a.chunk_size);
    let mut put = connect(&a.owner, "orbitkv-perf-peer-owner", 0)?;
    let mut get = connect(&a.requester, "orbitkv-perf-peer-requester", 1)?;
    put.register_namespace(&ns).map_err(|source| Error::Client { client: 0, source })?;
    get.register_namespace(&ns).map_err(|source| Error::Client { client: 1, source })?;

    let (seed, keys) = put_chunks(a, &mut put, &ns, (&owner, &requester))?;

    // Remote and raw reads alternate, batch by batch, so that both see the same moments of a
    // shared host.
    let mut raw = raw.start(a)?;
    let mut check =
        Verify { seed, expected: vec![0u8; a.chunk_size as usize], ..Verify::default() };
    let (samples, rest) = keys.split_at(a.latency_samples as usize);
    let (mut first_byte, mut te_first_byte) = (Latency::default(), Latency::default());
    for (i, k) in samples.iter().enumerate() {
        let t = Instant::now();
        let leases = get
            .lookup_leased(std::slice::from_ref(k))
            .map_err(|source| Error::Client { client: 1, source })?;
        first_byte.record(t.elapsed());
        check.leases(&mut get, &leases, i as u64)?;
        check.missed += 1 - leases.len() as u64;
        te_first_byte.record(raw.read(1)?);
    }
    let (mut spent, mut te_spent) = (Duration::ZERO, Duration::ZERO);
    let mut pairs = Vec::new();
    for (b, part) in rest.chunks(a.batch as usize).enumerate() {
        let t = Instant::now();
        let leases =
            get.lookup_leased(part).map_err(|source| Error::Client { client: 1, source })?;
        let remote = t.elapsed();
        spent += remote;
        let first = samples.len() as u64 + (b * a.batch as usize) as u64;
        check.leases(&mut get, &leases, first)?;
        check.missed += (part.len() - leases.len()) as u64;
        let te = raw.read(part.len() as u64)?;
        te_spent += te;
        pairs.push((remote, te));
    }
    raw.verify()?;
    let bytes = a.chunks as u64 * a.chunk_size;
    let gbps = |d: Duration| bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9;
    let (remote_gbps, te_gbps) = (gbps(spent), gbps(te_spent));
    Ok(PeerReport {
        owner,
        requester,
        chunk_bytes: a.chunk_size,
        chunks: a.chunks as u64,
        batch: a.batch as u64,
        remote_gbps,
        te_gbps,
        ratio: if te_gbps > 0.0 { remote_gbps / te_gbps } else { 0.0 },
        paired_ratio: paired(&pairs),
        lookup_us_p50: median_us(pairs.iter().map(|p| p.0)),
        te_batch_us_p50: median_us(pairs.iter().map(|p| p.1)),
        first_byte: (&first_byte).into(),
        te_first_byte: (&te_first_byte).into(),
        verified_chunks: check.verified,
        wrong_chunks: check.wrong,
        missed_chunks: check.missed,
    })
}

/// The 10th, 50th and 90th percentile of `te / remote` over `(remote, te)` pairs (0 without
/// pairs).
fn paired(pairs: &[(Duration, Duration)]) -> [f64; 3] {
    let mut r: Vec<f64> = pairs
        .iter()
        .map(|(remote, te)| te.as_secs_f64() / remote.as_secs_f64().max(1e-9))
        .collect();
    r.sort_by(f64::total_cmp);
    let at =
        |q: f64| r.get(((r.len().max(1) - 1) as f64 * q).round() as usize).copied().unwrap_or(0.0);
    [at(0.1), at(0.5), at(0.9)]
}

/// The median of `d` in microseconds (0 when empty).
fn median_us(d: impl Iterator<Item = Duration>) -> f64 {
    let us: Vec<f64> = d.map(|d| d.as_secs_f64() * 1e6).collect();
    crate::stats::median(&us).unwrap_or(0.0)
}

/// Checks what the requester answered against the bytes put.
#[derive(Default)]
struct Verify {
    seed: u64,
    expected: Vec<u8>,
    verified: u64,
    wrong: u64,
    missed: u64,
}

impl Verify {
    /// `leases` answer keys numbered from `first`: each must be a peer hit with the chunk's
    /// bytes; all are released.
    fn leases(
        &mut self,
        get: &mut Client,
        leases: &[orbitkv_client::Lease],
        first: u64,
    ) -> Result<(), Error> {
        for (j, l) in leases.iter().enumerate() {
            fill(self.seed, first + j as u64, &mut self.expected);
            let bytes = get.chunk(l).map_err(|source| Error::Client { client: 1, source })?;
            self.verified += 1;
            if l.hit.tier != Tier::Peer || bytes != self.expected.as_slice() {
                self.wrong += 1;
            }
        }
        get.release(leases).map_err(|source| Error::Client { client: 1, source })?;
        Ok(())
    }
}

mod te {
    use std::time::{Duration, Instant};

    use orbitkv_peer::Engine;

    use super::fill;
    use crate::args::PeerArgs;
    use crate::error::Error;

    fn te_err(e: impl std::fmt::Display) -> Error {
        Error::Setup(format!("raw Transfer Engine baseline: {e}"))
    }

    /// An engine on the route the Managers use: the C API of the TE build named by
    /// `--te-library`, else the wheel's (builds with `te-python`).
    fn engine(a: &PeerArgs) -> Result<Engine, Error> {
        Engine::start("127.0.0.1", a.te_library.as_deref(), a.te_transport)
            .map_err(te_err)?
            .ok_or_else(|| {
                Error::Setup(
                    "no Transfer Engine: give --te-library (a TE build's C API library), or build \
                 orbitkv-perf with `--features te-python` (and PYO3_PYTHON naming a Python with \
                 the pinned Mooncake wheel)"
                        .into(),
                )
            })
    }

    /// Two engines of this process on loopback TCP, one batch of buffer each side.
    pub(super) struct Baseline {
        reader: Engine,
        owner: Engine,
        src: Vec<u8>,
        dst: Vec<u8>,
    }

    /// A started baseline: its buffers registered, its connection open.
    pub(super) struct Running {
        b: Baseline,
        peer: String,
        chunk: u64,
    }

    impl Baseline {
        /// The engines (started first: a missing engine fails before anything is put).
        pub(super) fn new(a: &PeerArgs) -> Result<Self, Error> {
            let bytes = (a.batch as u64 * a.chunk_size) as usize;
            let (owner, reader) = (engine(a)?, engine(a)?);
            let mut src = vec![0u8; bytes];
            for (i, c) in src.chunks_mut(a.chunk_size as usize).enumerate() {
                fill(7, i as u64, c);
            }
            Ok(Self { reader, owner, src, dst: vec![0u8; bytes] })
        }

        /// Registers the buffers and opens the connection (one untimed read).
        pub(super) fn start(self, a: &PeerArgs) -> Result<Running, Error> {
            // The buffers live, unmoved, as long as the engines (both in `Running`).
            let len = self.src.len() as u64;
            self.owner.register(self.src.as_ptr() as u64, len).map_err(te_err)?;
            self.reader.register(self.dst.as_ptr() as u64, len).map_err(te_err)?;
            let peer = self.owner.segment().to_owned();
            let mut r = Running { b: self, peer, chunk: a.chunk_size };
            r.read(1)?;
            Ok(r)
        }
    }

    impl Running {
        /// Reads the first `n` chunks of the owner's buffer in one batch; how long it took.
        pub(super) fn read(&mut self, n: u64) -> Result<Duration, Error> {
            let (src, dst) = (self.b.src.as_ptr() as u64, self.b.dst.as_mut_ptr() as u64);
            let c = self.chunk;
            let ranges: Vec<(u64, u64, u64)> =
                (0..n).map(|j| (dst + j * c, src + j * c, c)).collect();
            let t = Instant::now();
            self.b.reader.read_many(&self.peer, &ranges).map_err(te_err)?;
            Ok(t.elapsed())
        }

        /// Checks that the bytes read are the owner's.
        pub(super) fn verify(&self) -> Result<(), Error> {
            if self.b.dst != self.b.src {
                return Err(Error::Setup("raw Transfer Engine baseline: bytes read differ".into()));
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> PeerArgs {
        PeerArgs {
            owner: "/nowhere/a.sock".into(),
            requester: "/nowhere/b.sock".into(),
            chunk_size: 1 << 20,
            chunks: 256,
            batch: 32,
            latency_samples: 100,
            te_library: None,
            te_transport: orbitkv_peer::TeTransport::Auto,
            json: false,
        }
    }

    #[test]
    fn bad_flags_are_named_before_connecting() {
        let why = |f: fn(&mut PeerArgs)| {
            let mut a = args();
            f(&mut a);
            check(&a).unwrap_err().to_string()
        };
        assert!(why(|a| a.chunk_size = 1000).contains("--chunk-size"));
        assert!(why(|a| a.chunk_size = 32 << 20).contains("--chunk-size"));
        assert!(why(|a| a.chunks = 0).contains("--chunks"));
        assert!(why(|a| a.batch = 0).contains("--batch"));
        assert!(why(|a| a.batch = 2000).contains("--batch"));
        assert!(why(|a| {
            a.chunk_size = 16 << 20;
            a.batch = 128;
        })
        .contains("1 GiB"));
        assert!(why(|a| a.latency_samples = 20_000).contains("--latency-samples"));
        assert!(why(|a| a.te_transport = orbitkv_peer::TeTransport::Tcp).contains("--te-transport"));
        assert!(check(&args()).is_ok());
    }

    #[test]
    fn paired_ratios_are_quantiles_of_raw_over_remote_time() {
        let ms = Duration::from_millis;
        assert_eq!(paired(&[]), [0.0; 3]);
        assert_eq!(paired(&[(ms(4), ms(2))]), [0.5; 3]);
        // Ten lookups: nine at 0.8 of the raw read's pace, one stalled.
        let mut pairs = vec![(ms(5), ms(4)); 9];
        pairs.push((ms(400), ms(4)));
        let [p10, p50, p90] = paired(&pairs);
        assert!((p50 - 0.8).abs() < 1e-9 && (p90 - 0.8).abs() < 1e-9, "{p50} {p90}");
        assert!((p10 - 0.8).abs() < 1e-9, "the stall is below the 10th percentile: {p10}");
        assert_eq!(median_us([ms(1), ms(3), ms(2)].into_iter()), 2000.0);
        assert_eq!(median_us([ms(1), ms(2)].into_iter()), 1500.0);
    }

    #[test]
    fn chunk_bytes_differ_between_chunks_and_runs() {
        let (mut a, mut b, mut c) = (vec![0u8; 4096], vec![0u8; 4096], vec![0u8; 4096]);
        fill(1, 0, &mut a);
        fill(1, 1, &mut b);
        fill(2, 0, &mut c);
        assert!(a != b && a != c);
        fill(1, 0, &mut b);
        assert_eq!(a, b, "deterministic");
    }
}
