//! One benchmark client: its own thread and session, the read-through main phase and the
//! batched-lookup phase.

use std::path::PathBuf;
use std::time::Instant;

use orbitkv_client::{
    ChunkKey, Client, ClientOptions, ErrorCode, Lease, NamespaceDescriptor, PutOutcome,
};
use orbitkv_proto::chunk_checksum;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::baseline::Bracket;
use crate::error::Error;
use crate::gate::Gate;
use crate::progress::Progress;
use crate::sampler::KeyPicker;
use crate::stats::{ClientStats, ErrorCounts};
use crate::workload::{fill_value, first_mismatch, KeySpace};

/// Lookup-set keys stored per put request during setup.
const SETUP_PUT_GROUP: usize = 64;
/// Rounds of re-putting lookup-set keys that went missing during setup.
const SETUP_ROUNDS: usize = 3;
/// Mismatches reported on stderr per client (all are counted).
const MISMATCH_REPORTS: u64 = 3;
/// Separates the lookup phase's random stream from the main phase's.
const LOOKUP_RNG_SALT: u64 = 0x6c6f_6f6b_7570;

/// What every client does; shared read-only.
#[derive(Debug)]
pub(crate) struct Plan {
    /// Bootstrap socket.
    pub socket: PathBuf,
    /// The benchmark namespace.
    pub namespace: NamespaceDescriptor,
    /// The run's seed.
    pub seed: u64,
    /// Bytes per value.
    pub value_size: usize,
    /// Key choice over the main keys.
    pub picker: KeyPicker,
    /// Never put: misses are only counted.
    pub verify_only: bool,
    /// The lookup phase, if any.
    pub lookup: Option<LookupPlan>,
    /// Consecutive keys per get.
    pub get_batch: usize,
    /// Main keys.
    pub nkeys: u64,
    /// `--baseline-every`: how often, and the yardstick's source (shared by the clients).
    pub baseline: Option<(std::time::Duration, std::sync::Arc<crate::baseline::Source>)>,
}

/// The batched-lookup phase.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LookupPlan {
    /// Keys per lookup.
    pub batch: usize,
    /// Keys in each client's lookup set.
    pub set_len: usize,
    /// Bytes per lookup-set value.
    pub value_len: usize,
}

/// The start lines of the two phases.
pub(crate) struct Gates {
    /// Start of the main phase.
    pub main: Gate,
    /// Start of the lookup phase (present when it runs).
    pub lookup: Option<Gate>,
}

/// Runs client `id` through both phases; returns what it counted.
pub(crate) fn run(id: usize, plan: &Plan, gates: &Gates, progress: &Progress) -> ClientStats {
    let (client, space) = match connect(id, plan) {
        Ok(c) => c,
        Err(e) => {
            gates.main.arrive(Err(e));
            return ClientStats::default();
        }
    };
    let mut w = Worker { id, client, space, plan, progress, stats: ClientStats::default() };
    let Some(end) = gates.main.arrive(Ok(())) else {
        return w.stats;
    };
    w.main_phase(end);
    if let (Some(lp), Some(gate)) = (plan.lookup, &gates.lookup) {
        let keys = w.lookup_setup(lp);
        if let Some(end) = gate.arrive(Ok(())) {
            w.lookup_phase(lp, &keys, end);
        }
    }
    w.stats
}

/// One client's session and counts.
struct Worker<'a> {
    id: usize,
    client: Client,
    space: KeySpace,
    plan: &'a Plan,
    progress: &'a Progress,
    stats: ClientStats,
}

fn connect(id: usize, plan: &Plan) -> Result<(Client, KeySpace), Error> {
    let client_err = |source| Error::Client { client: id, source };
    let mut client = Client::connect(ClientOptions {
        name: format!("orbitkv-perf-{id}"),
        ..ClientOptions::with_socket(&plan.socket)
    })
    .map_err(client_err)?;
    let info = client.register_namespace(&plan.namespace).map_err(client_err)?;
    if info.max_chunk_bytes < plan.value_size as u64 {
        return Err(Error::Setup(format!(
            "the server accepts chunks of at most {} bytes in the benchmark namespace, \
             values are {} bytes",
            info.max_chunk_bytes, plan.value_size
        )));
    }
    let space = KeySpace { namespace: info.id, seed: plan.seed };
    Ok((client, space))
}

/// The main phase's state across its gets: the random stream, the run of keys being got (and
/// their indices among the main keys), the buffers the hits are copied into, the values put
/// for the missing rest, and the yardstick's bracket.
struct MainRun<'p> {
    rng: SmallRng,
    bufs: Vec<Vec<u8>>,
    values: Vec<Vec<u8>>,
    keys: Vec<ChunkKey>,
    indices: Vec<u64>,
    bracket: Option<Bracket<'p>>,
}

impl Worker<'_> {
    /// Read-through cache: get (lookup with lease, copy, release) and put on a miss (unless
    /// the plan is verify-only). With `get_batch` > 1 each get is a run of consecutive keys:
    /// the present prefix is copied, the missing rest put.
    fn main_phase(&mut self, end: Instant) {
        let (id, plan, space, progress) = (self.id, self.plan, self.space, self.progress);
        let n = plan.get_batch;
        let mut run = MainRun {
            rng: SmallRng::seed_from_u64(plan.seed.wrapping_add(id as u64)),
            bufs: vec![vec![0u8; plan.value_size]; n],
            values: vec![vec![0u8; plan.value_size]; n],
            keys: Vec::with_capacity(n),
            indices: Vec::with_capacity(n),
            bracket: plan
                .baseline
                .as_ref()
                .map(|(every, source)| Bracket::start(source, *every, id)),
        };
        while Instant::now() < end {
            if let Some(b) = run.bracket.as_mut() {
                b.between(end);
            }
            let first = plan.picker.pick(&mut run.rng);
            run.indices.clear();
            run.indices.extend((0..n as u64).map(|k| (first + k) % plan.nkeys));
            run.keys.clear();
            run.keys.extend(run.indices.iter().map(|&i| space.key(i)));
            let started = Instant::now();
            let leases = match self.client.lookup_leased(&run.keys) {
                Ok(l) => l,
                Err(e) => {
                    self.stats.errors.client("lookup", &e);
                    continue;
                }
            };
            let hits = leases.len();
            let s = &mut self.stats.main;
            s.hits += hits as u64;
            s.misses += (n - hits) as u64;
            for k in 0..n {
                progress.op(k < hits);
            }
            if hits > 0 && !self.got(&mut run, &leases, started) {
                continue;
            }
            if hits == n || plan.verify_only {
                continue;
            }
            self.put_missing(&mut run, hits);
        }
        self.end_main_phase(run.bracket);
    }

    /// The hits of a get (`leases`, looked up from `started`): copied while leased, released,
    /// timed and verified. False when a chunk could not be read (an error; the get is not
    /// timed).
    fn got(&mut self, run: &mut MainRun<'_>, leases: &[Lease], started: Instant) -> bool {
        let (client, plan) = (&mut self.client, self.plan);
        let (s, errors) = (&mut self.stats.main, &mut self.stats.errors);
        // Copy while leased; a chunk of the wrong length is not copied and fails
        // verification.
        let copy_started = Instant::now();
        let (copied, failed) = copy_leased(client, leases, &mut run.bufs);
        s.copy_time += copy_started.elapsed();
        // One round trip per get: the release travels while the client verifies.
        let released = client.release_deferred(leases);
        let took = started.elapsed();
        if let Some(e) = failed {
            // The release of a lease that cannot be read fails for the same reason.
            errors.client("chunk", &e);
            return false;
        }
        count_release(released, errors);
        s.get.record(took);
        s.get_time += took;
        if let Some(b) = run.bracket.as_mut() {
            let copied_bytes = copied.iter().filter(|c| **c).count() * plan.value_size;
            b.got(copied_bytes as u64, took);
        }
        self.verify(run, leases, &copied);
        true
    }

    /// Checks each hit of a get against its key's bytes and its lease's checksum (`copied`:
    /// whether it was copied, being of the right length); a wrong one is counted, the first
    /// few said on stderr.
    fn verify(&mut self, run: &MainRun<'_>, leases: &[Lease], copied: &[bool]) {
        let (id, s) = (self.id, &mut self.stats.main);
        let (bufs, keys, indices) = (&run.bufs, &run.keys, &run.indices);
        for (k, lease) in leases.iter().enumerate() {
            let buf = &bufs[k];
            let mismatch = if copied[k] {
                s.get_bytes += buf.len() as u64;
                first_mismatch(&keys[k].digest, buf).map(|at| format!("byte {at} differs")).or_else(
                    || {
                        // The bytes are right; the checksum that travels with them
                        // (to SSD and peers) must describe them too.
                        (chunk_checksum(buf) != lease.hit.checksum).then(|| {
                            format!("checksum {:#x} in the lease is wrong", lease.hit.checksum)
                        })
                    },
                )
            } else {
                Some(format!("{} bytes instead of {}", lease.hit.len, buf.len()))
            };
            if let Some(what) = mismatch {
                s.verify_failures += 1;
                if s.verify_failures <= MISMATCH_REPORTS {
                    eprintln!(
                        "orbitkv-perf: client {id}: key {} read back wrong: {what}",
                        indices[k]
                    );
                }
            }
        }
    }

    /// The missing rest of a get's run (its keys after the first `hits`), put in one request.
    fn put_missing(&mut self, run: &mut MainRun<'_>, hits: usize) {
        let (s, errors) = (&mut self.stats.main, &mut self.stats.errors);
        // The missing rest of the run, put in one request.
        for (key, value) in run.keys[hits..].iter().zip(run.values.iter_mut()) {
            fill_value(&key.digest, value);
        }
        let items: Vec<(ChunkKey, &[u8])> =
            run.keys[hits..].iter().zip(&run.values).map(|(k, v)| (*k, v.as_slice())).collect();
        let started = Instant::now();
        let outcome = self.client.put(&items);
        let took = started.elapsed();
        match outcome {
            Ok(outcomes) => {
                s.put.record(took);
                for o in outcomes {
                    match o {
                        PutOutcome::Stored => s.put_stored += 1,
                        PutOutcome::AlreadyPresent => s.put_already_present += 1,
                        PutOutcome::Failed(ErrorCode::NoSpace | ErrorCode::Busy) => {
                            s.put_rejected += 1
                        }
                        PutOutcome::Failed(code) => errors.code("put", code),
                    }
                }
            }
            Err(e) if matches!(e.code(), Some(ErrorCode::NoSpace | ErrorCode::Busy)) => {
                s.put_rejected += 1
            }
            Err(e) => errors.client("put", &e),
        }
    }

    /// The end of the main phase: the deferred releases' answers, the bracket's windows and
    /// the phase's end.
    fn end_main_phase(&mut self, bracket: Option<Bracket<'_>>) {
        let (client, s, errors) = (&mut self.client, &mut self.stats.main, &mut self.stats.errors);
        // Deferred releases answer later; any that failed are errors of this run.
        if let Err(e) = client.flush() {
            errors.client("release", &e);
        }
        errors.count("release", client.deferred_failures());
        if let Some(b) = bracket {
            s.bracketed = b.finish();
        }
        s.ended = Some(Instant::now());
    }
}

/// Copies each leased chunk into its buffer, in order, until one cannot be read; returns
/// whether each was copied (a chunk of the wrong length is not) and the error that stopped
/// the copies.
fn copy_leased(
    client: &Client,
    leases: &[Lease],
    bufs: &mut [Vec<u8>],
) -> (Vec<bool>, Option<orbitkv_client::Error>) {
    let mut copied = Vec::with_capacity(leases.len());
    let mut failed = None;
    for (lease, buf) in leases.iter().zip(bufs.iter_mut()) {
        match client.chunk(lease) {
            Ok(bytes) if bytes.len() == buf.len() => {
                orbitkv_client::copy_chunk(buf, bytes);
                copied.push(true);
            }
            Ok(_) => copied.push(false),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    (copied, failed)
}

fn count_release(released: Result<(), orbitkv_client::Error>, errors: &mut ErrorCounts) {
    if let Err(e) = released {
        errors.client("release", &e);
    }
}

impl Worker<'_> {
    /// Puts this client's lookup set (small values, own key domain) until it is all present or
    /// the rounds run out; returns its keys.
    fn lookup_setup(&mut self, lp: LookupPlan) -> Vec<ChunkKey> {
        let (client, id, space, stats) = (&mut self.client, self.id, self.space, &mut self.stats);
        let keys: Vec<ChunkKey> =
            (0..lp.set_len as u64).map(|j| space.lookup_key(id as u64, j)).collect();
        let mut values = vec![vec![0u8; lp.value_len]; SETUP_PUT_GROUP];
        let mut present = 0;
        for round in 0..=SETUP_ROUNDS {
            present = match client.lookup(&keys) {
                Ok(hits) => hits.len(),
                Err(e) => {
                    stats.errors.client("lookup", &e);
                    0
                }
            };
            if present == keys.len() || round == SETUP_ROUNDS {
                break;
            }
            for group in keys[present..].chunks(SETUP_PUT_GROUP) {
                for (k, v) in group.iter().zip(values.iter_mut()) {
                    fill_value(&k.digest, v);
                }
                let items: Vec<(ChunkKey, &[u8])> =
                    group.iter().zip(&values).map(|(k, v)| (*k, v.as_slice())).collect();
                match client.put(&items) {
                    Ok(outcomes) => {
                        for o in outcomes {
                            match o {
                                PutOutcome::Stored | PutOutcome::AlreadyPresent => {}
                                PutOutcome::Failed(ErrorCode::NoSpace | ErrorCode::Busy) => {
                                    stats.main.put_rejected += 1
                                }
                                PutOutcome::Failed(code) => stats.errors.code("put", code),
                            }
                        }
                    }
                    Err(e) if matches!(e.code(), Some(ErrorCode::NoSpace | ErrorCode::Busy)) => {
                        stats.main.put_rejected += 1
                    }
                    Err(e) => stats.errors.client("put", &e),
                }
            }
        }
        stats.lookup.setup_missing = (keys.len() - present) as u64;
        keys
    }

    /// Unleased lookups of `batch` consecutive keys of the lookup set (a present prefix).
    fn lookup_phase(&mut self, lp: LookupPlan, keys: &[ChunkKey], end: Instant) {
        let (client, id, progress, stats) =
            (&mut self.client, self.id, self.progress, &mut self.stats);
        let mut rng =
            SmallRng::seed_from_u64(self.plan.seed ^ LOOKUP_RNG_SALT.wrapping_add(id as u64));
        // The plan guarantees 1 <= batch <= set_len.
        let windows = keys.len() - lp.batch + 1;
        let s = &mut stats.lookup;
        while Instant::now() < end {
            let first = rng.gen_range(0..windows);
            let batch = &keys[first..first + lp.batch];
            let started = Instant::now();
            let result = client.lookup(batch);
            let took = started.elapsed();
            progress.batch();
            match result {
                Ok(hits) => {
                    s.batch.record(took);
                    s.keys += batch.len() as u64;
                    if hits.len() != batch.len() {
                        s.short += 1;
                    }
                }
                Err(e) => stats.errors.client("lookup", &e),
            }
        }
        s.ended = Some(Instant::now());
    }
}
