//! GPU save/load through the server's DMA threads: register an engine rank's KV tensors (CUDA
//! IPC handles plus their layout), then save engine blocks into chunks and load them back.
//! The server copies; the engine's process only names blocks.
//!
//! A registration belongs to the session that made it: it ends with `unregister_gpu` or with
//! the session (a server restart included: then calls with it fail `Stale`, and the engine
//! registers again, getting a new generation).
//!
//! The engine's part of the contract: the blocks a save names hold their final bytes before
//! the save is sent (synchronize the stream that wrote them), and the blocks of a save or load
//! are not reused until its answer has arrived. When a call fails without an answer (a
//! timeout, a lost connection), the server may still be copying: the blocks stay off-limits
//! until the session has closed (the server closes it when the client's socket goes, and
//! finishes every copy before reclaiming anything).

use orbitkv_proto::{ChunkKey, ChunkOutcome, GpuTensor, KvLayoutSpec, Request, Response};

use crate::client::{unexpected, Client};
use crate::connection::PendingAnswer;
use crate::Error;

/// Fixed request overhead assumed when sizing save/load batches.
const REQUEST_OVERHEAD: u64 = 1024;

/// An engine rank's tensors registered with the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuRegistration {
    /// Registration id.
    pub id: u64,
    /// Its generation.
    pub generation: u64,
    epoch: u64,
}

/// A save or load sent and not yet answered (see [`Client::start_save`]). Dropping it cancels
/// what has not started: a request the server has not taken yet is withdrawn (nothing is
/// copied); one it has taken runs to the end (a save commits its chunks), because memory
/// under a copy is never given back early.
pub struct Transfer {
    pending: PendingAnswer,
    op: &'static str,
    keys: usize,
    epoch: u64,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("op", &self.op)
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

/// Which way a transfer copies.
#[derive(Clone, Copy)]
enum Way {
    Save,
    Load,
}

impl Way {
    fn name(self) -> &'static str {
        match self {
            Way::Save => "save",
            Way::Load => "load",
        }
    }

    fn request(self, r: &GpuRegistration, keys: &[ChunkKey], blocks: &[u64]) -> Request {
        let (registration, generation) = (r.id, r.generation);
        let (keys, blocks) = (keys.to_vec(), blocks.to_vec());
        match self {
            Way::Save => Request::Save { registration, generation, keys, blocks },
            Way::Load => Request::Load { registration, generation, keys, blocks },
        }
    }
}

fn check_blocks(keys: &[ChunkKey], blocks: &[u64]) -> Result<usize, Error> {
    if keys.is_empty() || blocks.is_empty() || !blocks.len().is_multiple_of(keys.len()) {
        return Err(Error::InvalidArgument(format!(
            "{} block ids for {} keys: give the same number (at least one) per key",
            blocks.len(),
            keys.len()
        )));
    }
    Ok(blocks.len() / keys.len())
}

impl Client {
    /// Registers an engine rank's KV tensors on the GPU `device_uuid` (`GPU-...`, as
    /// `nvidia-smi -L` prints it): one [`GpuTensor`] per tensor of `layout`, in its order.
    /// The server opens the handles and checks every tensor against the layout; an error
    /// names the field.
    pub fn register_gpu(
        &mut self,
        device_uuid: &str,
        layout: KvLayoutSpec,
        tensors: &[GpuTensor],
    ) -> Result<GpuRegistration, Error> {
        let req = Request::RegisterGpu {
            device_uuid: device_uuid.to_owned(),
            layout,
            tensors: tensors.to_vec(),
        };
        match self.call(&req)? {
            Response::GpuRegistered { registration, generation } => {
                Ok(GpuRegistration { id: registration, generation, epoch: self.epoch })
            }
            other => Err(unexpected("register_gpu", other)),
        }
    }

    /// Ends a registration; returns once no copy uses the engine's memory any more.
    pub fn unregister_gpu(&mut self, r: &GpuRegistration) -> Result<(), Error> {
        self.check_epoch(r)?;
        let req = Request::UnregisterGpu { registration: r.id, generation: r.generation };
        match self.call(&req)? {
            Response::GpuUnregistered => Ok(()),
            other => Err(unexpected("unregister_gpu", other)),
        }
    }

    fn check_epoch(&self, r: &GpuRegistration) -> Result<(), Error> {
        if r.epoch != self.live_epoch() {
            return Err(Error::Stale);
        }
        Ok(())
    }

    /// Keys per request for `per_chunk` block ids per key.
    fn transfer_batch(&self, per_chunk: usize) -> usize {
        let max_bytes = self.conn.as_ref().map_or(0, |c| c.max_request_bytes);
        let per_key = 64 + 8 * per_chunk as u64;
        let by_size = (max_bytes.saturating_sub(REQUEST_OVERHEAD) / per_key).max(1) as usize;
        self.max_keys().min(by_size)
    }

    fn transfer(
        &mut self,
        way: Way,
        r: &GpuRegistration,
        keys: &[ChunkKey],
        blocks: &[u64],
    ) -> Result<Vec<ChunkOutcome>, Error> {
        self.check_epoch(r)?;
        let per_chunk = check_blocks(keys, blocks)?;
        let batch = self.transfer_batch(per_chunk);
        let mut all = Vec::with_capacity(keys.len());
        for (kb, bb) in keys.chunks(batch).zip(blocks.chunks(batch * per_chunk)) {
            match self.call(&way.request(r, kb, bb))? {
                Response::Outcomes { outcomes } if outcomes.len() == kb.len() => {
                    all.extend(outcomes)
                }
                other => return Err(unexpected(way.name(), other)),
            }
            // A load is of the longest present prefix: once a chunk was not loaded, later
            // batches are not sent (their keys are not part of the prefix).
            if matches!(way, Way::Load) && all.iter().any(|o| *o != ChunkOutcome::Done) {
                let missing = ChunkOutcome::Failed(orbitkv_proto::ErrorCode::NotFound);
                all.resize(keys.len(), missing);
                break;
            }
        }
        Ok(all)
    }

    /// Copies engine blocks into new chunks and commits them: chunk `i` is
    /// `blocks[i * n .. (i + 1) * n]` with `n = blocks.len() / keys.len()`. One outcome per key
    /// (`AlreadyPresent` chunks are not copied again). Blocks until every copy has completed.
    pub fn save(
        &mut self,
        r: &GpuRegistration,
        keys: &[ChunkKey],
        blocks: &[u64],
    ) -> Result<Vec<ChunkOutcome>, Error> {
        self.transfer(Way::Save, r, keys, blocks)
    }

    /// Copies chunks back into engine blocks (same packing as [`Client::save`]). The longest
    /// present prefix of `keys` is loaded; later keys come back `NotFound`.
    pub fn load(
        &mut self,
        r: &GpuRegistration,
        keys: &[ChunkKey],
        blocks: &[u64],
    ) -> Result<Vec<ChunkOutcome>, Error> {
        self.transfer(Way::Load, r, keys, blocks)
    }

    fn start(
        &mut self,
        way: Way,
        r: &GpuRegistration,
        keys: &[ChunkKey],
        blocks: &[u64],
    ) -> Result<Transfer, Error> {
        self.check_epoch(r)?;
        let per_chunk = check_blocks(keys, blocks)?;
        let op = way.name();
        if keys.len() > self.transfer_batch(per_chunk) {
            return Err(Error::InvalidArgument(format!(
                "{} keys do not fit one {op} request (at most {}); use {op}() or split",
                keys.len(),
                self.transfer_batch(per_chunk)
            )));
        }
        let conn = self.conn.as_mut().ok_or(Error::Stale)?;
        let pending = conn.start(&way.request(r, keys, blocks))?;
        Ok(Transfer { pending, op, keys: keys.len(), epoch: r.epoch })
    }

    /// Starts a save of one request's worth of chunks and returns at once; see
    /// [`Client::poll_transfer`] and [`Client::wait_transfer`].
    pub fn start_save(
        &mut self,
        r: &GpuRegistration,
        keys: &[ChunkKey],
        blocks: &[u64],
    ) -> Result<Transfer, Error> {
        self.start(Way::Save, r, keys, blocks)
    }

    /// Starts a load of one request's worth of chunks and returns at once.
    pub fn start_load(
        &mut self,
        r: &GpuRegistration,
        keys: &[ChunkKey],
        blocks: &[u64],
    ) -> Result<Transfer, Error> {
        self.start(Way::Load, r, keys, blocks)
    }

    fn finish(&self, t: &Transfer, answer: Response) -> Result<Vec<ChunkOutcome>, Error> {
        match answer {
            Response::Outcomes { outcomes } if outcomes.len() == t.keys => Ok(outcomes),
            other => Err(unexpected(t.op, other)),
        }
    }

    /// The outcomes of a started transfer once it has completed; `None` while it runs.
    pub fn poll_transfer(&mut self, t: &Transfer) -> Result<Option<Vec<ChunkOutcome>>, Error> {
        if t.epoch != self.live_epoch() {
            return Err(Error::Stale);
        }
        let conn = self.conn.as_ref().ok_or(Error::Stale)?;
        match conn.poll(&t.pending, t.op)? {
            Some(answer) => self.finish(t, answer).map(Some),
            None => Ok(None),
        }
    }

    /// Waits for a started transfer (up to the request timeout). After a `Timeout` the
    /// transfer may still be running: wait or poll again; until it answers (or the session
    /// has ended), the blocks it names stay in use by the server.
    pub fn wait_transfer(&mut self, t: &Transfer) -> Result<Vec<ChunkOutcome>, Error> {
        if t.epoch != self.live_epoch() {
            return Err(Error::Stale);
        }
        let timeout = self.opts.request_timeout;
        let conn = self.conn.as_ref().ok_or(Error::Stale)?;
        let answer = conn.wait_answer(&t.pending, t.op, timeout)?;
        self.finish(t, answer)
    }
}
