//! The public client API.

use std::path::PathBuf;
use std::time::Duration;

use orbitkv_proto::{
    default_socket_path, ChunkKey, ChunkOutcome, ErrorCode, Hit, NamespaceDescriptor, Request,
    Reservation, Response, SlotRef,
};

use crate::backoff::Reconnect;
use crate::connection::Connection;
use crate::mapping::HostArena;
use crate::Error;

/// How to reach the server.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Bootstrap socket. Default: the same default as the server (`$ORBITKV_SOCKET`, ...).
    pub socket: PathBuf,
    /// Name shown in `orbitkv-ctl sessions`. Default: `orbitkv-client`.
    pub name: String,
    /// Longest wait for one response. Default: 10 s.
    pub request_timeout: Duration,
    /// Build the page tables of the whole arena mapping at connect (no first-touch faults on
    /// the data path, at the cost of a slower connect on very large arenas). Default: true.
    pub prefault_arena: bool,
    /// Wait after a failed connect before the next attempt; it doubles with each failure in a
    /// row up to [`ClientOptions::reconnect_backoff_max`]. Calls in between fail at once with
    /// [`Error::Unavailable`]. Default: 50 ms.
    pub reconnect_backoff: Duration,
    /// Longest wait between connect attempts. Default: 2 s.
    pub reconnect_backoff_max: Duration,
    /// Most threads one `put`, `save_blocks` or `load_blocks` copies with (the calling one
    /// among them), each given at least 4 MiB of chunks; 0 counts as 1. Default: 1.
    pub copy_threads: usize,
    /// `put` and `save_blocks` compute each chunk's checksum on the copying thread, right
    /// after writing it, and commit with them (`commit_checked`): the shards then hash one
    /// chunk per request instead of every one. Default: true.
    pub client_checksums: bool,
    /// Longest [`Client::connect`] waits for a server that says it is starting (populating
    /// its arena, ...), connecting again when it says; past it, [`Error::Starting`]. A lazy
    /// client ([`Client::new`]) never waits: its calls fail fast until the server serves.
    /// Default: 10 minutes.
    pub start_wait: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            socket: default_socket_path(nix::unistd::getuid().as_raw()),
            name: "orbitkv-client".into(),
            request_timeout: Duration::from_secs(10),
            prefault_arena: true,
            reconnect_backoff: Duration::from_millis(50),
            reconnect_backoff_max: Duration::from_secs(2),
            copy_threads: 1,
            client_checksums: true,
            start_wait: Duration::from_secs(600),
        }
    }
}

impl ClientOptions {
    /// Options for a given socket path, defaults otherwise.
    pub fn with_socket(socket: impl Into<PathBuf>) -> Self {
        Self { socket: socket.into(), ..Self::default() }
    }
}

/// A registered namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NamespaceInfo {
    /// Its id (the `namespace` of every [`ChunkKey`] in it).
    pub id: u64,
    /// Largest chunk accepted.
    pub max_chunk_bytes: u64,
}

/// A leased chunk: its bytes stay in place and unchanged until released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The chunk.
    pub key: ChunkKey,
    /// Where it is.
    pub hit: Hit,
    epoch: u64,
}

/// A reserved slot: write the chunk's bytes into it, then commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reserved {
    /// The chunk being written.
    pub key: ChunkKey,
    /// Offset in the arena.
    pub offset: u64,
    /// Length to write.
    pub len: u64,
    /// Generation to quote on commit.
    pub generation: u64,
    epoch: u64,
}

/// What `put` did with one chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutOutcome {
    /// Written and committed.
    Stored,
    /// Already present (or being written by another session); nothing written.
    AlreadyPresent,
    /// Not stored, for this reason.
    Failed(ErrorCode),
}

/// One session with the local `orbitkv-server`. See the crate docs. `Send`: a session may
/// move between threads, but is used by one at a time (`&mut self`).
#[derive(Debug)]
pub struct Client {
    pub(crate) opts: ClientOptions,
    pub(crate) conn: Option<Connection>,
    /// Incremented on every new connection; leases and reservations carry the epoch they
    /// were made in, so nothing from an earlier session is used against a new one.
    pub(crate) epoch: u64,
    namespaces: Vec<NamespaceDescriptor>,
    reconnect: Reconnect,
}

pub(crate) fn unexpected(op: &str, r: Response) -> Error {
    match r {
        Response::Error { code, message } => Error::Server { code, message },
        other => Error::Protocol(format!("unexpected answer to {op}: {other:?}")),
    }
}

impl Client {
    /// Connects now; fails if the server is not reachable or refuses. A server that is
    /// starting is waited for, up to [`ClientOptions::start_wait`].
    pub fn connect(opts: ClientOptions) -> Result<Self, Error> {
        let deadline = std::time::Instant::now() + opts.start_wait;
        let mut c = Self::new(opts);
        loop {
            match c.ensure_connected() {
                Ok(_) => return Ok(c),
                Err(Error::Starting { retry_in, .. })
                    if std::time::Instant::now() + retry_in < deadline =>
                {
                    std::thread::sleep(retry_in)
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// A client that connects on its first call (and reconnects after, with backoff): for an
    /// engine that must start whether or not the server is up. Never fails.
    pub fn new(opts: ClientOptions) -> Self {
        Self { opts, conn: None, epoch: 0, namespaces: Vec::new(), reconnect: Reconnect::default() }
    }

    /// Whether a session is open now (no call is made; a server gone since the last answer
    /// shows at the next call).
    pub fn is_connected(&self) -> bool {
        self.conn.is_some()
    }

    /// Connect attempts made so far, successful or not.
    pub fn connect_attempts(&self) -> u64 {
        self.reconnect.attempts
    }

    /// The options this client was made with.
    pub fn options(&self) -> &ClientOptions {
        &self.opts
    }

    /// The current session id (None between a disconnect and the next call). A restarted
    /// Manager numbers its sessions from 1 again: to tell this client's connections apart,
    /// use [`Client::connection`].
    pub fn session_id(&self) -> Option<u64> {
        self.conn.as_ref().map(|c| c.session_id)
    }

    /// The number of the current connection of this client, new at every connect (None
    /// while disconnected): leases, reservations and the arena mapping belong to one.
    pub fn connection(&self) -> Option<u64> {
        self.conn.as_ref().map(|_| self.epoch)
    }

    /// Drops a session whose server has gone (noticed without a call): its holdings are
    /// `Stale` from now on, and the next call reconnects.
    pub(crate) fn notice_ended(&mut self) {
        if self.conn.as_ref().is_some_and(|c| !c.recently_alive()) {
            tracing::info!("orbitkv-server session ended; the next call reconnects");
            self.conn = None;
        }
    }

    pub(crate) fn ensure_connected(&mut self) -> Result<&mut Connection, Error> {
        self.notice_ended();
        if self.conn.is_none() {
            self.reconnect.check(&self.opts.socket)?;
            let opened = self.open_session();
            let (initial, max) = (self.opts.reconnect_backoff, self.opts.reconnect_backoff_max);
            self.reconnect.record(opened.as_ref().map(|_| ()), initial, max);
            self.conn = Some(opened?);
            if self.epoch > 0 {
                tracing::info!("reconnected to orbitkv-server");
            }
            self.epoch += 1;
        }
        Ok(self.conn.as_mut().expect("connected just above"))
    }

    /// A new session with this client's namespaces registered again.
    fn open_session(&self) -> Result<Connection, Error> {
        let mut conn = Connection::open(&self.opts)?;
        for d in &self.namespaces {
            let req = Request::RegisterNamespace { descriptor: d.clone() };
            match conn.call(&req, self.opts.request_timeout)? {
                Response::Registered { .. } => {}
                // A server that refuses a namespace (its limits changed with a restart) does
                // not keep the session from opening: that namespace's calls get the refusal.
                Response::Error { code, message } => {
                    tracing::warn!(model = %d.model, %code, %message, "namespace refused on reconnect")
                }
                other => return Err(unexpected("register", other)),
            }
        }
        Ok(conn)
    }

    pub(crate) fn call(&mut self, req: &Request) -> Result<Response, Error> {
        self.ensure_connected()?;
        self.call_live(req)
    }

    /// Sends `req` on the live session. An error that leaves it unusable drops it (the server
    /// reclaims its holdings when the socket closes); the next call reconnects.
    fn call_live(&mut self, req: &Request) -> Result<Response, Error> {
        let timeout = self.opts.request_timeout;
        let conn = self.conn.as_mut().ok_or(Error::Stale)?;
        let answer = conn.call(req, timeout);
        if answer.as_ref().is_err_and(Error::ends_session) {
            self.conn = None;
        }
        answer
    }

    /// As [`Client::call`], for a request about holdings of the session of `epoch` (its
    /// leases or reservations, or the batches after the first of one operation): it never
    /// reconnects. `Stale` when that session has ended, noticed now or before; a new session
    /// would not know those holdings (or would take new ones the caller never sees).
    pub(crate) fn call_pinned(&mut self, epoch: u64, req: &Request) -> Result<Response, Error> {
        self.notice_ended();
        if self.live_epoch() != epoch {
            return Err(Error::Stale);
        }
        self.call_live(req)
    }

    /// The epoch of the live connection (0 when disconnected: matches nothing).
    pub(crate) fn live_epoch(&self) -> u64 {
        if self.conn.is_some() {
            self.epoch
        } else {
            0
        }
    }

    pub(crate) fn max_keys(&self) -> usize {
        self.conn.as_ref().map_or(1, |c| c.max_keys_per_request as usize).max(1)
    }

    /// Sends arbitrary bytes as a request and returns the server's answer. For protocol
    /// conformance tests and fuzzing: the server must answer anything with an error, never
    /// crash.
    #[doc(hidden)]
    pub fn call_raw(&mut self, bytes: &[u8]) -> Result<Response, Error> {
        let timeout = self.opts.request_timeout;
        self.ensure_connected()?.call_bytes(bytes, "raw", timeout)
    }

    /// Round trip to the server.
    pub fn ping(&mut self) -> Result<(), Error> {
        match self.call(&Request::Ping)? {
            Response::Pong => Ok(()),
            other => Err(unexpected("ping", other)),
        }
    }

    /// Registers a namespace (idempotent for identical descriptors). A valid descriptor is
    /// remembered even when the server cannot be reached (the call then fails
    /// [`Error::is_unavailable`]): every session this client opens registers it, so an engine
    /// that started before its server can go on with the id ([`NamespaceDescriptor::id`]).
    pub fn register_namespace(&mut self, d: &NamespaceDescriptor) -> Result<NamespaceInfo, Error> {
        d.validate().map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let answer = self.call(&Request::RegisterNamespace { descriptor: d.clone() });
        let remember = match &answer {
            Ok(Response::Registered { .. }) => true,
            Err(e) => e.is_unavailable(),
            Ok(_) => false,
        };
        if remember && !self.namespaces.contains(d) {
            self.namespaces.push(d.clone());
        }
        match answer? {
            Response::Registered { namespace, max_chunk_bytes } => {
                Ok(NamespaceInfo { id: namespace, max_chunk_bytes })
            }
            other => Err(unexpected("register", other)),
        }
    }

    /// Looks `keys` up in batches of at most the server's per-request key count; returns the
    /// hits and the epoch they belong to. A failure (or a reconnect) after the first batch
    /// gives back the leases earlier batches took, so nothing stays held behind the caller's
    /// back.
    fn lookup_raw(&mut self, keys: &[ChunkKey], lease: bool) -> Result<(Vec<Hit>, u64), Error> {
        self.ensure_connected()?;
        let epoch = self.epoch;
        let mut all: Vec<Hit> = Vec::new();
        for batch in keys.chunks(self.max_keys()) {
            let answer =
                match self.call_pinned(epoch, &Request::Lookup { keys: batch.to_vec(), lease }) {
                    Ok(Response::Lookup { hits }) if hits.len() <= batch.len() => Ok(hits),
                    Ok(other) => Err(unexpected("lookup", other)),
                    Err(e) => Err(e),
                };
            match answer {
                Ok(hits) => {
                    let complete = hits.len() == batch.len();
                    all.extend(hits);
                    if !complete {
                        break;
                    }
                }
                Err(e) => {
                    if lease && !all.is_empty() && self.live_epoch() == epoch {
                        let held: Vec<Lease> = keys
                            .iter()
                            .zip(&all)
                            .map(|(key, hit)| Lease { key: *key, hit: *hit, epoch })
                            .collect();
                        let _ = self.release(&held);
                    }
                    return Err(e);
                }
            }
        }
        Ok((all, epoch))
    }

    /// The longest present prefix of `keys` (no lease: the chunks may go at any time).
    pub fn lookup(&mut self, keys: &[ChunkKey]) -> Result<Vec<Hit>, Error> {
        Ok(self.lookup_raw(keys, false)?.0)
    }

    /// The longest present prefix of `keys`, leased: each stays readable until released.
    pub fn lookup_leased(&mut self, keys: &[ChunkKey]) -> Result<Vec<Lease>, Error> {
        let (hits, epoch) = self.lookup_raw(keys, true)?;
        Ok(keys.iter().zip(hits).map(|(key, hit)| Lease { key: *key, hit, epoch }).collect())
    }

    /// Zero-copy view of a leased chunk, valid while the lease is held.
    pub fn chunk(&self, lease: &Lease) -> Result<&[u8], Error> {
        let conn =
            self.conn.as_ref().filter(|_| lease.epoch == self.live_epoch()).ok_or(Error::Stale)?;
        conn.arena.bytes(lease.hit.offset, lease.hit.len).map_err(Error::from)
    }

    /// Releases leases; the outcome per lease is `Done` or why not.
    pub fn release(&mut self, leases: &[Lease]) -> Result<Vec<ChunkOutcome>, Error> {
        let epoch = leases.first().map_or(self.live_epoch(), |l| l.epoch);
        if leases.iter().any(|l| l.epoch != epoch) {
            return Err(Error::Stale);
        }
        let slots: Vec<SlotRef> =
            leases.iter().map(|l| SlotRef { key: l.key, generation: l.hit.generation }).collect();
        self.outcomes("release", epoch, &slots, |slots| Request::Release { slots })
    }

    /// Releases leases without waiting for the server's answer: the release travels while
    /// the caller goes on, and its answer is collected by a later call. A release that fails
    /// (it cannot, for leases this session holds) is logged and counted in
    /// [`Client::deferred_failures`].
    pub fn release_deferred(&mut self, leases: &[Lease]) -> Result<(), Error> {
        self.notice_ended();
        let epoch = self.live_epoch();
        if leases.iter().any(|l| l.epoch != epoch) {
            return Err(Error::Stale);
        }
        let timeout = self.opts.request_timeout;
        let max = self.max_keys();
        for batch in leases.chunks(max) {
            let slots: Vec<SlotRef> = batch
                .iter()
                .map(|l| SlotRef { key: l.key, generation: l.hit.generation })
                .collect();
            let conn = self.conn.as_mut().ok_or(Error::Stale)?;
            if let Err(e) = conn.send_deferred(&Request::Release { slots }, timeout) {
                // A refusal (the caller's held transfers fill the session) leaves it as it is.
                if e.ends_session() {
                    self.conn = None;
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Waits until every deferred request of this session has been answered: releases, and
    /// transfers dropped before their answer (see [`crate::Transfer`]).
    pub fn flush(&mut self) -> Result<(), Error> {
        let timeout = self.opts.request_timeout;
        let Some(conn) = self.conn.as_mut() else { return Ok(()) };
        let flushed = conn.flush_deferred(timeout);
        if flushed.is_err() {
            self.conn = None;
        }
        flushed
    }

    /// Deferred requests of the current session that failed (each is also logged).
    pub fn deferred_failures(&self) -> u64 {
        self.conn.as_ref().map_or(0, |c| c.deferred_failures)
    }

    /// Sends `items` in batches as `make` builds the request, each pinned to the session of
    /// `epoch` (the holdings they name are that session's).
    fn outcomes<T: Clone>(
        &mut self,
        op: &str,
        epoch: u64,
        items: &[T],
        make: impl Fn(Vec<T>) -> Request,
    ) -> Result<Vec<ChunkOutcome>, Error> {
        let mut all = Vec::with_capacity(items.len());
        for batch in items.chunks(self.max_keys()) {
            match self.call_pinned(epoch, &make(batch.to_vec()))? {
                Response::Outcomes { outcomes } if outcomes.len() == batch.len() => {
                    all.extend(outcomes)
                }
                other => return Err(unexpected(op, other)),
            }
        }
        Ok(all)
    }

    /// Copies the longest present prefix of `keys` into `bufs` (one buffer per key) and
    /// returns the length of each chunk copied. Chunks are leased during the copy; the
    /// release is deferred (see [`Client::release_deferred`]), so a get costs one round trip.
    pub fn get_into(
        &mut self,
        keys: &[ChunkKey],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<usize>, Error> {
        if bufs.len() < keys.len() {
            return Err(Error::InvalidArgument(format!(
                "{} keys but {} buffers",
                keys.len(),
                bufs.len()
            )));
        }
        let leases = self.lookup_leased(keys)?;
        let mut lens = Vec::with_capacity(leases.len());
        let mut failure = None;
        for (lease, buf) in leases.iter().zip(bufs.iter_mut()) {
            let bytes = match self.chunk(lease) {
                Ok(b) => b,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            };
            if buf.len() < bytes.len() {
                failure = Some(Error::BufferTooSmall { needed: lease.hit.len, got: buf.len() });
                break;
            }
            crate::mapping::copy_chunk(&mut buf[..bytes.len()], bytes);
            lens.push(bytes.len());
        }
        self.release_deferred(&leases)?;
        match failure {
            Some(e) => Err(e),
            None => Ok(lens),
        }
    }

    /// Reserves slots for new chunks; one result per key (`AlreadyPresent`, `NoSpace`, ...).
    pub fn reserve(
        &mut self,
        keys: &[ChunkKey],
        lens: &[u64],
    ) -> Result<Vec<Result<Reserved, ErrorCode>>, Error> {
        if keys.len() != lens.len() {
            return Err(Error::InvalidArgument(format!(
                "{} keys but {} lengths",
                keys.len(),
                lens.len()
            )));
        }
        let mut all: Vec<Result<Reserved, ErrorCode>> = Vec::with_capacity(keys.len());
        let max = self.max_keys();
        self.ensure_connected()?;
        let epoch = self.epoch;
        for (kb, lb) in keys.chunks(max).zip(lens.chunks(max)) {
            let req = Request::Reserve { keys: kb.to_vec(), lens: lb.to_vec() };
            let answer = match self.call_pinned(epoch, &req) {
                Ok(Response::Reserved { slots }) if slots.len() == kb.len() => {
                    // A slot of another length than asked would be written out of bounds or
                    // short: the server broke the protocol.
                    match slots
                        .iter()
                        .zip(lb)
                        .find(|(s, &l)| matches!(s, Reservation::Slot { len, .. } if *len != l))
                    {
                        Some((Reservation::Slot { len, .. }, l)) => Err(Error::Protocol(format!(
                            "reserve answered a slot of {len} bytes for a chunk of {l}"
                        ))),
                        _ => Ok(slots),
                    }
                }
                Ok(other) => Err(unexpected("reserve", other)),
                Err(e) => Err(e),
            };
            match answer {
                Ok(slots) => all.extend(kb.iter().zip(slots).map(|(key, s)| match s {
                    Reservation::Slot { offset, len, generation } => {
                        Ok(Reserved { key: *key, offset, len, generation, epoch })
                    }
                    Reservation::Failed(code) => Err(code),
                })),
                Err(e) => {
                    // Give back what earlier batches reserved.
                    let made: Vec<Reserved> = all.into_iter().filter_map(Result::ok).collect();
                    if !made.is_empty() && self.live_epoch() == epoch {
                        let _ = self.abort(&made);
                    }
                    return Err(e);
                }
            }
        }
        Ok(all)
    }

    /// This session's mapping of the arena: start and length (None while disconnected). An
    /// engine that copies with its own GPU registers it with CUDA (`cuMemHostRegister`) so
    /// that its copy engines write slots and read leased chunks directly. The mapping ends
    /// with the session: a call that fails with a lost connection unmaps it, and the next
    /// call maps the arena anew. Check that [`Client::session_id`] is still the one the
    /// registration was made for before each copy, and register again when it is not.
    pub fn arena_range(&self) -> Option<(*mut u8, usize)> {
        self.conn.as_ref().map(|c| c.arena.range())
    }

    /// New descriptors of this session's arena memfds, in order (None while disconnected): for
    /// a mapping of its own (`orbitkv_shards::Arena::open` maps them one after another, as
    /// the server and this client do), e.g. one registered with CUDA for the engine's own
    /// copies. Offsets in it are those of [`Reserved::offset`] and of a lease's `hit.offset`.
    /// The next session may map another arena (after a restart): check
    /// [`Client::session_id`] before each copy.
    pub fn arena_fds(&self) -> Option<std::io::Result<Vec<std::os::fd::OwnedFd>>> {
        self.conn.as_ref().map(|c| c.arena.dup_fds())
    }

    /// Offset and length of each of the arena's memfds in [`Client::arena_range`]'s mapping, in
    /// order (None while disconnected): register each with CUDA on its own (one registration
    /// per file mapping).
    pub fn arena_files(&self) -> Option<Vec<(u64, u64)>> {
        self.conn.as_ref().map(|c| c.arena.files())
    }

    /// A mapping of this session's arena of one's own ([`HostArena`]), for an engine that
    /// registers it with CUDA and copies between its GPU memory and the slots itself: unlike
    /// [`Client::arena_range`]'s, it stays mapped when the session ends. Connects first when
    /// disconnected.
    pub fn map_arena(&mut self) -> Result<HostArena, Error> {
        self.ensure_connected()?;
        let epoch = self.epoch;
        let conn = self.conn.as_ref().expect("ensure_connected leaves a connection");
        HostArena::new(&conn.arena, epoch)
            .map_err(|e| Error::Ipc(format!("mapping the arena again: {e}")))
    }

    /// The writable bytes of a reservation.
    pub fn slot_mut(&mut self, r: &Reserved) -> Result<&mut [u8], Error> {
        let epoch = self.live_epoch();
        let conn = self.conn.as_mut().filter(|_| r.epoch == epoch).ok_or(Error::Stale)?;
        conn.arena.bytes_mut(r.offset, r.len).map_err(Error::from)
    }

    /// The reservations' references and the epoch of their session (`Stale` if they are of
    /// different sessions; a session since ended shows when they are sent).
    fn slot_refs(&self, slots: &[Reserved]) -> Result<(Vec<SlotRef>, u64), Error> {
        let epoch = slots.first().map_or(self.live_epoch(), |s| s.epoch);
        if slots.iter().any(|s| s.epoch != epoch) {
            return Err(Error::Stale);
        }
        Ok((
            slots.iter().map(|s| SlotRef { key: s.key, generation: s.generation }).collect(),
            epoch,
        ))
    }

    /// Makes written reservations visible.
    pub fn commit(&mut self, slots: &[Reserved]) -> Result<Vec<ChunkOutcome>, Error> {
        let (refs, epoch) = self.slot_refs(slots)?;
        self.outcomes("commit", epoch, &refs, |slots| Request::Commit { slots })
    }

    /// Makes written reservations visible with checksums the caller computed
    /// (`checksums[i]`: [`orbitkv_proto::chunk_checksum`] of `slots[i]`'s bytes, for example
    /// by its own GPU kernel), so that the shards do not read every chunk. The server checks
    /// the first of each request against its bytes: if it is wrong, that chunk fails with
    /// `ChecksumMismatch` (not stored) and the others are committed with checksums the
    /// shards compute. The others are otherwise taken as given: a wrong one makes its chunk
    /// fail later checks (SSD, peers), it never makes wrong bytes served.
    pub fn commit_checked(
        &mut self,
        slots: &[Reserved],
        checksums: &[u64],
    ) -> Result<Vec<ChunkOutcome>, Error> {
        if slots.len() != checksums.len() {
            return Err(Error::InvalidArgument(format!(
                "{} slots but {} checksums",
                slots.len(),
                checksums.len()
            )));
        }
        let (refs, epoch) = self.slot_refs(slots)?;
        let items: Vec<(SlotRef, u64)> = refs.into_iter().zip(checksums.iter().copied()).collect();
        self.outcomes("commit_checked", epoch, &items, |items| {
            let (slots, checksums) = items.into_iter().unzip();
            Request::CommitChecked { slots, checksums }
        })
    }

    /// Gives reservations back unwritten.
    pub fn abort(&mut self, slots: &[Reserved]) -> Result<Vec<ChunkOutcome>, Error> {
        let (refs, epoch) = self.slot_refs(slots)?;
        self.outcomes("abort", epoch, &refs, |slots| Request::Abort { slots })
    }

    /// Stores chunks: reserve, copy each into its slot, commit.
    pub fn put(&mut self, items: &[(ChunkKey, &[u8])]) -> Result<Vec<PutOutcome>, Error> {
        let keys: Vec<ChunkKey> = items.iter().map(|(k, _)| *k).collect();
        let lens: Vec<u64> = items.iter().map(|(_, v)| v.len() as u64).collect();
        self.put_with(&keys, &lens, |i| std::iter::once(items[i].1))
    }

    /// Stores chunks whose bytes are `pieces(i)`, in order, for chunk `i` (`lens[i]` bytes in
    /// all): reserve, copy each into its slot (on up to `copy_threads` threads, two chunks side
    /// by side, hashing as they go when `client_checksums` is on), commit.
    pub(crate) fn put_with<'s, P: Iterator<Item = &'s [u8]> + Clone>(
        &mut self,
        keys: &[ChunkKey],
        lens: &[u64],
        pieces: impl Fn(usize) -> P + Sync,
    ) -> Result<Vec<PutOutcome>, Error> {
        let reserved = self.reserve(keys, lens)?;
        let mut out = Vec::with_capacity(keys.len());
        let mut to_commit = Vec::new();
        let mut positions = Vec::new();
        for (i, r) in reserved.into_iter().enumerate() {
            match r {
                Ok(slot) => {
                    to_commit.push(slot);
                    positions.push(i);
                    out.push(PutOutcome::Stored);
                }
                Err(ErrorCode::AlreadyPresent | ErrorCode::Busy) => {
                    out.push(PutOutcome::AlreadyPresent)
                }
                Err(code) => out.push(PutOutcome::Failed(code)),
            }
        }
        let bytes = to_commit.iter().map(|s| s.len).sum();
        let threads = self.copy_threads(bytes, to_commit.len());
        let stores = crate::copies::stores_for(bytes);
        let summed = self.opts.client_checksums;
        let mut sums = vec![0u64; to_commit.len()];
        match self.slots_mut(&to_commit) {
            Ok(slots) => {
                let mut items = positions.iter().copied().zip(slots).zip(sums.iter_mut());
                // Chunks two by two, a pair copied side by side, where that leaves every thread
                // a pair.
                let paired = to_commit.len() >= 2 * threads;
                let mut pairs = Vec::with_capacity(to_commit.len());
                while let Some(((i, slot), sum)) = items.next() {
                    let b = if paired { items.next() } else { None };
                    pairs.push(((i, slot, sum), b.map(|((i, s), m)| (i, s, m))));
                }
                crate::copies::for_each(threads, pairs, |(a, b)| {
                    use crate::copies::SlotWriter;
                    let (ia, slot_a, sum_a) = a;
                    let mut wa = SlotWriter::new(slot_a, summed, stores);
                    match b {
                        Some((ib, slot_b, sum_b)) => {
                            let mut wb = SlotWriter::new(slot_b, summed, stores);
                            SlotWriter::write_pieces_pair(&mut wa, pieces(ia), &mut wb, pieces(ib));
                            *sum_b = wb.finish();
                        }
                        None => pieces(ia).for_each(|p| wa.write(p)),
                    }
                    *sum_a = wa.finish();
                });
            }
            Err(e) => {
                let _ = self.abort(&to_commit);
                return Err(e);
            }
        }
        if !to_commit.is_empty() {
            let committed = if summed {
                self.commit_checked(&to_commit, &sums)
            } else {
                self.commit(&to_commit)
            };
            let outcomes = match committed {
                Ok(o) => o,
                Err(e) => {
                    // Best effort: if the session is still up, do not leave slots reserved.
                    let _ = self.abort(&to_commit);
                    return Err(e);
                }
            };
            for (i, o) in positions.into_iter().zip(outcomes) {
                if let ChunkOutcome::Failed(code) = o {
                    out[i] = PutOutcome::Failed(code);
                }
            }
        }
        Ok(out)
    }

    /// The bytes of reserved slots of the live session, all at once (for copies on several
    /// threads).
    fn slots_mut(&mut self, slots: &[Reserved]) -> Result<Vec<&mut [u8]>, Error> {
        let epoch = self.live_epoch();
        if slots.iter().any(|s| s.epoch != epoch) {
            return Err(Error::Stale);
        }
        let ranges: Vec<(u64, u64)> = slots.iter().map(|s| (s.offset, s.len)).collect();
        match self.conn.as_mut() {
            Some(conn) => conn.arena.bytes_mut_many(&ranges).map_err(Error::from),
            None if slots.is_empty() => Ok(Vec::new()),
            None => Err(Error::Stale),
        }
    }

    /// Threads for copying `bytes` in `items` pieces: at most `copy_threads`, each with at
    /// least [`crate::copies::MIN_BYTES_PER_THREAD`].
    pub(crate) fn copy_threads(&self, bytes: u64, items: usize) -> usize {
        let by_bytes = (bytes / crate::copies::MIN_BYTES_PER_THREAD).max(1);
        self.opts.copy_threads.min(items).min(by_bytes as usize).max(1)
    }

    /// Removes chunks that nobody leases.
    pub fn evict(&mut self, keys: &[ChunkKey]) -> Result<Vec<ChunkOutcome>, Error> {
        self.ensure_connected()?;
        let epoch = self.epoch;
        self.outcomes("evict", epoch, keys, |keys| Request::Evict { keys })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn client_is_send() {
        fn assert_send<T: Send>() {}
        assert_send::<super::Client>();
    }
}
