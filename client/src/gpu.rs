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

/// Requests of one save or load too large for a single request kept in flight at once: the
/// next one's reservations or lookups then run while the copies of the one before do, instead
/// of the DMA thread waiting a round trip between them.
const TRANSFER_WINDOW: usize = 2;

/// Runs one request per part, in order, with up to `window` in flight: `start(ctx, i)` sends
/// part `i` (of `sizes[i]` keys), `wait(ctx, t)` waits for its outcomes. With `prefix` (a load
/// of the longest present prefix), once a part has a chunk not `Done` no later part is sent;
/// the later parts already sent are waited for (their copies may be running; an error of
/// theirs changes nothing) and, with those never sent, reported `NotFound`, as every key after
/// a missing one is. On an error, no further part is sent and every part already sent is
/// still waited for (so that no copy of this call runs on after it returns, whenever the server
/// answers); then the first error is returned. An error that ends the session
/// ([`Error::ends_session`]: no usable answer) returns at once: the caller drops the session,
/// and the server finishes its copies before reclaiming anything.
fn pipelined<C, T>(
    ctx: &mut C,
    sizes: &[usize],
    window: usize,
    prefix: bool,
    mut start: impl FnMut(&mut C, usize) -> Result<T, Error>,
    mut wait: impl FnMut(&mut C, T) -> Result<Vec<ChunkOutcome>, Error>,
) -> Result<Vec<ChunkOutcome>, Error> {
    let not_found = ChunkOutcome::Failed(orbitkv_proto::ErrorCode::NotFound);
    let mut all = Vec::with_capacity(sizes.iter().sum());
    let mut sent = std::collections::VecDeque::with_capacity(window);
    let (mut next, mut missing) = (0, false);
    let mut failed: Option<Error> = None;
    loop {
        while next < sizes.len() && sent.len() < window.max(1) && !missing && failed.is_none() {
            match start(ctx, next) {
                Ok(t) => sent.push_back(t),
                Err(e) if e.ends_session() => return Err(e),
                Err(e) => failed = Some(e),
            }
            next += 1;
        }
        let Some(t) = sent.pop_front() else { break };
        match wait(ctx, t) {
            _ if failed.is_some() => {}
            Ok(outcomes) if missing => all.extend(std::iter::repeat_n(not_found, outcomes.len())),
            Ok(outcomes) => {
                missing = prefix && outcomes.iter().any(|o| *o != ChunkOutcome::Done);
                all.extend(outcomes);
            }
            Err(e) if e.ends_session() => return Err(e),
            // Sent only in case the prefix went on: its keys are reported missing anyway.
            Err(_) if missing => {}
            Err(e) => failed = Some(e),
        }
    }
    if let Some(e) = failed {
        return Err(e);
    }
    // The parts never sent (after a missing chunk), and those after it whose answers failed.
    all.resize(sizes.iter().sum(), not_found);
    Ok(all)
}

/// An engine rank's tensors registered with the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuRegistration {
    /// Registration id.
    pub id: u64,
    /// Its generation.
    pub generation: u64,
    epoch: u64,
}

/// A save or load sent and not yet answered (see [`Client::start_save`]). Dropping it does not
/// stop it: the server runs it to the end (a save commits its chunks, a load writes the
/// engine's blocks), and the session counts it among its requests in flight until the server
/// answers. Later calls collect that answer as they do a deferred release's (a failure is
/// logged and counted in [`Client::deferred_failures`]); [`Client::flush`] waits for it, after
/// which the blocks a dropped load named are the engine's again.
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

    /// Ends a registration; returns once no copy uses the engine's memory any more and the
    /// server has closed its import of it (unless another registration of the same allocation
    /// still holds it): the engine may then free that memory.
    pub fn unregister_gpu(&mut self, r: &GpuRegistration) -> Result<(), Error> {
        self.check_epoch(r)?;
        let req = Request::UnregisterGpu { registration: r.id, generation: r.generation };
        match self.call_pinned(r.epoch, &req)? {
            Response::GpuUnregistered => Ok(()),
            other => Err(unexpected("unregister_gpu", other)),
        }
    }

    /// `Stale` unless `r` is of the live session (a session that ended unnoticed is noticed
    /// here: sent on, the request would reach a new session, which knows nothing of `r`).
    fn check_epoch(&mut self, r: &GpuRegistration) -> Result<(), Error> {
        self.notice_ended();
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
        let parts: Vec<(&[ChunkKey], &[u64])> =
            keys.chunks(batch).zip(blocks.chunks(batch * per_chunk)).collect();
        let window = match self.conn.as_mut() {
            Some(c) => TRANSFER_WINDOW.min(c.free_request_slots()),
            None => 1,
        };
        let prefix = matches!(way, Way::Load);
        let sizes: Vec<usize> = parts.iter().map(|(k, _)| k.len()).collect();
        let out = pipelined(
            self,
            &sizes,
            window,
            prefix,
            |c: &mut Client, i| c.start(way, r, parts[i].0, parts[i].1),
            |c: &mut Client, t: Transfer| c.wait_transfer(&t),
        );
        if out.as_ref().is_err_and(Error::ends_session) {
            // As every blocking call does: drop the unusable session (its copies finish on the
            // server before anything is reclaimed) and reconnect on the next call.
            self.conn = None;
        }
        out
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
    /// present prefix of `keys` is loaded; later keys come back `NotFound`. (Keys too many for
    /// one request go in several, two in flight at a time: the blocks of a later one may have
    /// been written even if an earlier one found a key missing. All of them are the load's
    /// blocks, untouched by the engine until this returns.)
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
        let timeout = self.opts.request_timeout;
        let conn = self.conn.as_mut().ok_or(Error::Stale)?;
        let pending = conn.start(&way.request(r, keys, blocks), timeout)?;
        Ok(Transfer { pending, op, keys: keys.len(), epoch: r.epoch })
    }

    /// Starts any request as a transfer is started, for tests of how the session counts and
    /// collects started requests (a save or load needs a GPU).
    #[doc(hidden)]
    pub fn start_raw(&mut self, req: &Request) -> Result<Transfer, Error> {
        let timeout = self.opts.request_timeout;
        let keys = req.key_count();
        self.ensure_connected()?;
        let epoch = self.live_epoch();
        let conn = self.conn.as_mut().ok_or(Error::Stale)?;
        let pending = conn.start(req, timeout)?;
        Ok(Transfer { pending, op: req.op_name(), keys, epoch })
    }

    /// Starts a save of one request's worth of chunks and returns at once; see
    /// [`Client::poll_transfer`] and [`Client::wait_transfer`]. Every `Transfer` held counts
    /// against the session's requests in flight (the server's `--max-inflight-per-session`,
    /// with pending releases): where the held ones fill it, this and any other call are
    /// refused with `InvalidArgument` until one is taken or dropped; the session goes on.
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
        match conn.poll(&t.pending)? {
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
        let answer = conn.wait_answer(&t.pending, timeout)?;
        self.finish(t, answer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orbitkv_proto::ErrorCode;

    const DONE: ChunkOutcome = ChunkOutcome::Done;
    const MISSING: ChunkOutcome = ChunkOutcome::Failed(ErrorCode::NotFound);

    /// A server stand-in: part `i` answers `answers[i]`; it records what was sent and the most
    /// requests in flight at once, and fails where told.
    #[derive(Default)]
    struct Mock {
        answers: Vec<Vec<ChunkOutcome>>,
        sent: Vec<usize>,
        in_flight: usize,
        most_in_flight: usize,
        fail_start: Option<usize>,
        fail_wait: Option<usize>,
        /// The failures end the session (no usable answer) instead of being the server's.
        fatal: bool,
    }

    impl Mock {
        fn new(answers: Vec<Vec<ChunkOutcome>>) -> Self {
            Self { answers, ..Self::default() }
        }

        /// The error a failure gives: the session's end, or the server's answer.
        fn error(&self, message: String) -> Error {
            if self.fatal {
                Error::Disconnected(message)
            } else {
                Error::Server { code: ErrorCode::DeviceError, message }
            }
        }

        fn run(&mut self, window: usize, prefix: bool) -> Result<Vec<ChunkOutcome>, Error> {
            let sizes: Vec<usize> = self.answers.iter().map(Vec::len).collect();
            pipelined(
                self,
                &sizes,
                window,
                prefix,
                |m: &mut Mock, i| {
                    if m.fail_start == Some(i) {
                        return Err(m.error(format!("start {i}")));
                    }
                    m.sent.push(i);
                    m.in_flight += 1;
                    m.most_in_flight = m.most_in_flight.max(m.in_flight);
                    Ok(i)
                },
                |m: &mut Mock, i: usize| {
                    m.in_flight -= 1;
                    if m.fail_wait == Some(i) {
                        return Err(if m.fatal {
                            let after = std::time::Duration::from_millis(i as u64);
                            Error::Timeout { op: "load", after }
                        } else {
                            m.error(format!("wait {i}"))
                        });
                    }
                    Ok(m.answers[i].clone())
                },
            )
        }
    }

    #[test]
    fn parts_run_in_order_with_the_window_in_flight() {
        let mut m = Mock::new(vec![vec![DONE; 3], vec![DONE, MISSING], vec![DONE; 3], vec![DONE]]);
        // A save: a failed chunk does not stop later parts.
        let all = m.run(2, false).unwrap();
        assert_eq!(all, [vec![DONE; 3], vec![DONE, MISSING], vec![DONE; 4]].concat());
        assert_eq!((m.sent.clone(), m.most_in_flight), (vec![0, 1, 2, 3], 2));
        let mut m = Mock::new(vec![vec![DONE; 2]; 5]);
        assert_eq!(m.run(1, false).unwrap(), vec![DONE; 10]);
        assert_eq!(m.most_in_flight, 1, "a window of one is one request at a time");
        let mut m = Mock::new(vec![vec![DONE]; 3]);
        assert_eq!(m.run(0, true).unwrap(), vec![DONE; 3]);
        assert_eq!(m.most_in_flight, 1, "a window of zero still sends");
    }

    #[test]
    fn a_load_stops_at_the_first_missing_chunk() {
        let answers =
            vec![vec![DONE; 2], vec![DONE, MISSING, MISSING], vec![DONE; 2], vec![DONE; 2]];
        let mut m = Mock::new(answers.clone());
        let all = m.run(2, true).unwrap();
        // Part 2 was in flight when part 1's answer came: waited for, reported missing;
        // part 3 was never sent.
        assert_eq!(all, [vec![DONE; 2], vec![DONE], vec![MISSING; 6]].concat());
        assert_eq!(m.sent, vec![0, 1, 2]);
        assert_eq!(m.in_flight, 0, "every request sent was waited for");
        let mut m = Mock::new(answers);
        assert_eq!(m.run(1, true).unwrap().len(), 9);
        assert_eq!(m.sent, vec![0, 1], "one at a time: nothing after the miss is sent");
    }

    #[test]
    fn an_error_ends_the_transfer_once_nothing_sent_is_still_running() {
        let mut m = Mock::new(vec![vec![DONE]; 4]);
        m.fail_wait = Some(1);
        assert!(
            matches!(m.run(2, false), Err(Error::Server { message, .. }) if message == "wait 1")
        );
        assert_eq!(m.sent, vec![0, 1, 2], "part 2 was in flight; part 3 never went");
        assert_eq!(m.in_flight, 0, "part 2 was waited for before the error came back");
        let mut m = Mock::new(vec![vec![DONE]; 4]);
        m.fail_start = Some(2);
        assert!(
            matches!(m.run(2, false), Err(Error::Server { message, .. }) if message == "start 2")
        );
        assert_eq!((m.sent.clone(), m.in_flight), (vec![0, 1], 0));
        let mut m = Mock::new(vec![vec![DONE]; 4]);
        m.fail_start = Some(1);
        assert!(m.run(2, false).is_err());
        assert_eq!((m.sent.clone(), m.in_flight), (vec![0], 0), "part 0 was waited for");
    }

    #[test]
    fn an_error_that_ends_the_session_returns_at_once() {
        let mut m = Mock::new(vec![vec![DONE]; 4]);
        (m.fail_wait, m.fatal) = (Some(0), true);
        assert!(matches!(m.run(2, false), Err(Error::Timeout { .. })));
        assert_eq!((m.sent.clone(), m.in_flight), (vec![0, 1], 1), "part 1 left to the session");
        let mut m = Mock::new(vec![vec![DONE]; 4]);
        (m.fail_start, m.fatal) = (Some(1), true);
        assert!(matches!(m.run(2, false), Err(Error::Disconnected(_))));
        assert_eq!((m.sent.clone(), m.in_flight), (vec![0], 1));
    }

    #[test]
    fn a_failed_answer_after_a_loads_missing_chunk_changes_nothing() {
        let mut m = Mock::new(vec![vec![DONE, MISSING], vec![DONE; 2], vec![DONE]]);
        m.fail_wait = Some(1);
        assert_eq!(m.run(2, true).unwrap(), [vec![DONE], vec![MISSING; 4]].concat());
        assert_eq!((m.sent.clone(), m.in_flight), (vec![0, 1], 0));
    }
}
