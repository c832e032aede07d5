//! The `engine-gather` rows of `--interference` through the server: the matmul loop's
//! process gathers its pages into its staging, shared with the server by CUDA IPC, and the
//! server copies the staging's chunks to the arena (loads the reverse); this process passes
//! the batches between the two.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use orbitkv_client::{ChunkKey, ChunkOutcome, Client, GpuTensor, KvLayoutKind, KvLayoutSpec};

use super::engine::{client_err, not_done, Engine};
use crate::dma::matmul_loop::{EngineSide, MatmulLoop};
use crate::error::Error;

/// The `engine-gather` rows: the matmul loop's process gathers its pages into its staging, as
/// an engine with the engine-side gather does (docs/operations.md), and the server copies the
/// staging's chunks to the arena with copy engines (a cross-layer registration of the staging,
/// one block per chunk); loads the reverse. This process passes the batches between the two.
pub(super) struct Gathered {
    pub(super) reg: orbitkv_client::GpuRegistration,
    ns: u64,
    seed: u64,
    chunk_len: u64,
    /// Chunks per staging slot, and the slots.
    per_slot: usize,
    depth: usize,
    /// The next batch a save names, and the batches saved last (most recent last; loads
    /// cycle over them, all still in the arena).
    next: u64,
    saved: VecDeque<u64>,
    loads: usize,
}

/// Batches of the `engine-gather` saves that its loads cycle over (batches of at most a
/// staging part, 32 MiB by default: up to 512 MiB, well inside what the arena keeps of the
/// latest saves).
const GATHERED_KEPT: usize = 16;

impl Gathered {
    /// Registers the matmul loop's staging with the server, if it shared it and its slots
    /// hold whole chunks (else None, said on stderr).
    pub(super) fn register(
        client: &mut Client,
        matmul: &MatmulLoop,
        shape: EngineSide,
        (e, keys): (&Engine<'_>, &[ChunkKey]),
        seed: u64,
    ) -> Result<Option<Self>, Error> {
        let st = match matmul.staging() {
            Ok(st) => st,
            Err(why) => {
                eprintln!("--interference: no engine-gather rows: the matmul loop shared no staging ({why})");
                return Ok(None);
            }
        };
        let Some((per_slot, depth)) = staging_slots(shape, e.chunk_len) else {
            eprintln!(
                "--interference: staging batches of {} bytes do not hold whole chunks of {}; \
                 no engine-gather rows",
                shape.batch_bytes, e.chunk_len
            );
            return Ok(None);
        };
        let blocks = (per_slot * depth) as u64;
        if st.len < blocks * e.chunk_len {
            return Err(Error::Gpu(format!(
                "--interference: the shared staging has {} bytes, not {}",
                st.len,
                blocks * e.chunk_len
            )));
        }
        // One cross-layer block per chunk: 1 layer, 1 token, 1 head of chunk_len / 2 bytes,
        // K and V.
        let layout = KvLayoutSpec {
            kind: KvLayoutKind::CrossLayer,
            num_layers: 1,
            num_blocks: blocks,
            block_size: 1,
            kv_heads: 1,
            head_dim: u32::try_from(e.chunk_len / 2)
                .map_err(|_| Error::Gpu("--interference: chunks too large to stage".into()))?,
            elem_bytes: 1,
        };
        let tensor = GpuTensor { handle: st.handle, offset: st.offset, len: blocks * e.chunk_len };
        let reg = client
            .register_gpu(e.device_uuid, layout, &[tensor])
            .map_err(client_err("register_gpu (engine staging)"))?;
        let ns = keys.first().map_or(0, |k| k.namespace);
        Ok(Some(Self {
            reg,
            ns,
            seed,
            chunk_len: e.chunk_len,
            per_slot,
            depth,
            next: 0,
            saved: VecDeque::new(),
            loads: 0,
        }))
    }

    /// The keys of batch `b` (fresh for every saved batch).
    fn keys(&self, b: u64) -> Vec<ChunkKey> {
        (0..self.per_slot as u64)
            .map(|i| {
                let mut h = blake3::Hasher::new();
                h.update(b"orbitkv-perf-gather");
                h.update(&self.seed.to_le_bytes());
                h.update(&b.to_le_bytes());
                h.update(&i.to_le_bytes());
                ChunkKey::new(self.ns, *h.finalize().as_bytes())
            })
            .collect()
    }

    /// The staging blocks of slot `j`.
    fn blocks(&self, j: usize) -> Vec<u64> {
        let first = (j * self.per_slot) as u64;
        (first..first + self.per_slot as u64).collect()
    }

    /// The next batch to load: the saved ones in turn.
    fn next_load(&mut self) -> Option<u64> {
        let b = *self.saved.get(self.loads % self.saved.len().max(1))?;
        self.loads += 1;
        Some(b)
    }

    /// Starts the transfer of a batch through staging slot `j`: a save (`way`) of a fresh
    /// batch, or a load of the next saved one. Returns (slot, batch, transfer).
    fn start(
        &mut self,
        client: &mut Client,
        j: usize,
        way: &'static str,
    ) -> Result<(usize, u64, orbitkv_client::Transfer), Error> {
        let save = way == "save";
        let (b, t) = if save {
            let b = self.next;
            self.next += 1;
            (b, client.start_save(&self.reg, &self.keys(b), &self.blocks(j)))
        } else {
            let b = self.next_load().expect("saved batches");
            (b, client.start_load(&self.reg, &self.keys(b), &self.blocks(j)))
        };
        t.map(|t| (j, b, t)).map_err(client_err(way))
    }

    /// Batch `b`'s transfer through slot `j` answered `o`: the slot goes back to the matmul
    /// loop (after a save, the batch is kept for the loads if stored whole). Returns (chunks
    /// done, chunks not done).
    fn finish(
        &mut self,
        m: &mut MatmulLoop,
        j: usize,
        b: u64,
        o: &[ChunkOutcome],
        save: bool,
    ) -> Result<(u64, u64), Error> {
        if save {
            // Only a batch stored whole is loaded later.
            if not_done(o) == 0 {
                self.saved.push_back(b);
            }
            if self.saved.len() > GATHERED_KEPT {
                self.saved.pop_front();
            }
            m.command(&format!("free {j}"))
        } else {
            m.command(&format!("loaded {j} {b}"))
        }
        .map(|()| (o.len() as u64 - not_done(o), not_done(o)))
    }
}

/// (chunks per staging slot, slots) of the engine-side copies' staging, when a slot holds
/// whole chunks (the slot's pages as the matmul loop works them out).
fn staging_slots(shape: EngineSide, chunk_len: u64) -> Option<(usize, usize)> {
    let page = shape.page_bytes.max(1);
    let per = (shape.batch_bytes / page).min(shape.pool_bytes / page).max(1);
    let slot = per * page;
    (chunk_len > 0 && slot.is_multiple_of(chunk_len) && shape.depth > 0)
        .then(|| ((slot / chunk_len) as usize, shape.depth as usize))
}

/// One `engine-gather` measurement (`way` save or load): the batches the matmul loop hands
/// over are saved from (or loaded into) its staging through the server for a window, timed
/// from the first completed; returns (products per second meanwhile, GB/s the server moved,
/// chunks not done). Every transfer started is waited for before the loop is told to stop.
pub(super) fn engine_gather(
    m: &mut MatmulLoop,
    client: &mut Client,
    g: &mut Gathered,
    way: &'static str,
) -> Result<(f64, f64, u64), Error> {
    let save = way == "save";
    if !save && g.saved.is_empty() {
        return Err(Error::Gpu("--interference: engine-gather loads before any save".into()));
    }
    m.forget_handoffs();
    m.command(if save { "save-server" } else { "load-server" })?;
    // (slot, batch, transfer) in start order.
    let mut inflight: VecDeque<(usize, u64, orbitkv_client::Transfer)> = VecDeque::new();
    if !save {
        for j in 0..g.depth {
            inflight.push_back(g.start(client, j, way)?);
        }
    }
    let (window, moved, mut not_done_) = gather_window(m, client, g, way, &mut inflight)?;
    let (t0, m0) = window;
    let (took, m1) = (t0.elapsed().as_secs_f64(), m.mark());
    while let Some((j, b, t)) = inflight.pop_front() {
        let o = client.wait_transfer(&t).map_err(client_err(way))?;
        not_done_ += g.finish(m, j, b, &o, save)?.1;
    }
    m.command("idle")?;
    Ok((m.rate(m0, m1), moved as f64 / took / 1e9, not_done_))
}

/// The body of [`engine_gather`]: starts a transfer for every slot the matmul loop hands over
/// and finishes those that complete, until a window has passed since the first completed.
/// Returns when that window began (and the loop's mark then), the bytes moved since, and the
/// chunks not done; the transfers still in flight stay in `inflight`.
fn gather_window(
    m: &mut MatmulLoop,
    client: &mut Client,
    g: &mut Gathered,
    way: &'static str,
    inflight: &mut VecDeque<(usize, u64, orbitkv_client::Transfer)>,
) -> Result<((Instant, usize), u64, u64), Error> {
    use crate::dma::matmul_loop::{Handoff, WINDOW};
    let save = way == "save";
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut window: Option<(Instant, usize)> = None;
    let (mut moved, mut not_done_) = (0u64, 0u64);
    loop {
        let mut busy = false;
        while let Some(h) = m.handoff(Duration::ZERO) {
            busy = true;
            let j = match h {
                Handoff::Staged(j) if save => j,
                Handoff::Scattered(j) if !save => j,
                _ => continue,
            };
            if j >= g.depth {
                return Err(Error::Gpu(format!("--interference: the matmul loop named slot {j}")));
            }
            inflight.push_back(g.start(client, j, way)?);
        }
        let mut k = 0;
        while k < inflight.len() {
            match client.poll_transfer(&inflight[k].2).map_err(client_err(way))? {
                Some(o) => {
                    let (j, b, _) = inflight.remove(k).expect("in range");
                    let (done, missed) = g.finish(m, j, b, &o, save)?;
                    not_done_ += missed;
                    match window {
                        Some(_) => moved += done * g.chunk_len,
                        None => window = Some((Instant::now(), m.mark())),
                    }
                    busy = true;
                }
                None => k += 1,
            }
        }
        if let Some((t0, _)) = window {
            if t0.elapsed() >= WINDOW {
                break;
            }
        } else if Instant::now() >= deadline || m.ended() {
            let _ = m.command("idle");
            return Err(Error::Gpu(format!(
                "--interference: the engine-gather {way}s completed nothing within 30 s"
            )));
        }
        if !busy {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
    let window = window.expect("the loop ends inside a window");
    Ok((window, moved, not_done_))
}

#[cfg(test)]
mod tests {
    use super::{staging_slots, EngineSide};

    #[test]
    fn engine_gather_slots_hold_whole_chunks_or_there_are_none() {
        let shape = |page: u64, batch: u64, pool: u64, depth: u32| EngineSide {
            page_bytes: page,
            batch_bytes: batch,
            pool_bytes: pool,
            depth,
        };
        // 32 MiB batches of 2 KiB pages: sixteen 2 MiB chunks per slot, four slots.
        assert_eq!(staging_slots(shape(2048, 32 << 20, 2 << 30, 4), 2 << 20), Some((16, 4)));
        // mla's 18 KiB pages in batches cut to whole 576 KiB chunks (56 of them).
        let mla = 576 << 10;
        assert_eq!(staging_slots(shape(18 << 10, 56 * mla, 2 << 30, 4), mla), Some((56, 4)));
        // A batch that is not whole chunks, a pool smaller than a chunk, no chunk: none.
        assert_eq!(staging_slots(shape(18 << 10, 32 << 20, 2 << 30, 4), mla), None);
        assert_eq!(staging_slots(shape(2048, 32 << 20, 1 << 20, 4), 2 << 20), None);
        assert_eq!(staging_slots(shape(2048, 32 << 20, 2 << 30, 4), 0), None);
    }
}
