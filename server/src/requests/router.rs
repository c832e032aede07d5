//! Request handling on a session's home shard: validate, split by owning shard, execute
//! (locally or over the mesh), gather, answer.

use std::rc::Rc;
use std::time::Instant;

use orbitkv_proto::{
    decode, encode, ChunkKey, ChunkOutcome, ErrorCode, Hit, Request, Reservation, Response, SlotRef,
};
use orbitkv_shards::{OpKind, SessionId, ShardOp, ShardReply};

use crate::control::access::Denied;
use crate::control::shared::ServeState;
use crate::requests::fanout::{
    commit_given, lookup, outcomes, per_slot, reserve, scatter, Check, OnWrongChecksum, FAILED,
};
use crate::shard::context::{Exec, SessionCounters};
use crate::shard::ipc::ActiveRequest;

/// Fixed part of the request size bound, on top of 64 bytes per key.
const REQUEST_OVERHEAD: usize = 4096;

/// Largest encoded request accepted with `max_keys` keys per request.
pub fn max_request_bytes(max_keys: u32) -> usize {
    max_keys as usize * 64 + REQUEST_OVERHEAD
}

/// Largest encoded response with `max_keys` keys per request.
pub fn max_response_bytes(max_keys: u32) -> usize {
    max_keys as usize * 64 + REQUEST_OVERHEAD
}

fn op_kind(r: &Request) -> OpKind {
    match r {
        Request::Lookup { .. } => OpKind::Lookup,
        Request::Reserve { .. } => OpKind::Reserve,
        Request::Commit { .. } | Request::CommitChecked { .. } => OpKind::Commit,
        Request::Release { .. } => OpKind::Release,
        Request::Save { .. } => OpKind::Save,
        Request::Load { .. } => OpKind::Load,
        _ => OpKind::Other,
    }
}

/// Takes one received request: rejects what is malformed or over a bound at once, executes
/// the rest in a task of this executor.
pub(crate) fn dispatch(
    exec: &Rc<Exec>,
    session: SessionId,
    counters: SessionCounters,
    req: ActiveRequest,
) {
    let started = Instant::now();
    let cfg = &exec.shared.settings.config;
    let payload: &[u8] = req.payload();
    let reject = |code: ErrorCode, message: String| {
        exec.rejected.set(exec.rejected.get() + 1);
        exec.core.borrow_mut().metrics.count_error(code);
        Response::error(code, message)
    };
    let request = if payload.len() > max_request_bytes(cfg.max_keys_per_request) {
        Err(reject(
            ErrorCode::TooLarge,
            format!(
                "request of {} bytes exceeds {} bytes (--max-keys-per-request {})",
                payload.len(),
                max_request_bytes(cfg.max_keys_per_request),
                cfg.max_keys_per_request
            ),
        ))
    } else {
        decode::<Request>(payload).map_err(|e| reject(ErrorCode::Malformed, e.to_string()))
    };
    // A write is counted as admitted before its check of the state, and until answered: a
    // drain is done only once none is left (see `Shared::admit_write`).
    let admitted = match &request {
        Ok(Request::Reserve { .. } | Request::Save { .. }) => Some(exec.shared.admit_write()),
        _ => None,
    };
    let request =
        request.and_then(|r| check(exec, &counters, &r).map(|()| r).map_err(|(c, m)| reject(c, m)));
    match request {
        Err(response) => {
            exec.respond(req, &encode(&response));
            counters.done();
        }
        Ok(request) => {
            let exec = Rc::clone(exec);
            exec.active.set(exec.active.get() + 1);
            glommio::spawn_local(async move {
                let kind = op_kind(&request);
                let holds = matches!(
                    request,
                    Request::Reserve { .. } | Request::Lookup { lease: true, .. }
                );
                let response = execute(&exec, session, &counters, request).await;
                if let Response::Error { code, .. } = &response {
                    exec.core.borrow_mut().metrics.count_error(*code);
                }
                if !(holds && late_or_lost_reply(&exec).await) {
                    exec.respond(req, &encode(&response));
                }
                drop(admitted);
                counters.done();
                exec.active.set(exec.active.get() - 1);
                exec.core
                    .borrow_mut()
                    .metrics
                    .record_latency(kind, started.elapsed().as_nanos() as u64);
            })
            .detach();
        }
    }
}

/// Tests only (failpoints, never in release builds): the answer of a request that took leases
/// or reservations comes late (`session-reply-delay`, `return(DUR)`: the client may give up or
/// die meanwhile) or never (`session-reply-drop`, `return`: true, counted as a dropped reply).
/// Builds without the feature answer false at once: `fail::eval` reads a locked registry even
/// there, which the request path does not need.
#[cfg(not(feature = "failpoints"))]
async fn late_or_lost_reply(_: &Exec) -> bool {
    false
}

/// See the other `late_or_lost_reply`.
#[cfg(feature = "failpoints")]
async fn late_or_lost_reply(exec: &Exec) -> bool {
    let delay = fail::eval("session-reply-delay", |arg| arg).flatten();
    if let Some(d) = delay.and_then(|d| orbitkv_proto::parse_duration(&d).ok()) {
        glommio::timer::sleep(d).await;
    }
    let lost = fail::eval("session-reply-drop", |_| ()).is_some();
    if lost {
        exec.dropped_replies.set(exec.dropped_replies.get() + 1);
    }
    lost
}

/// Takes namespace `d` for the session's uid ([`crate::control::access::NamespaceOwners::claim`]).
fn claim_namespace(
    exec: &Exec,
    session: SessionId,
    d: &orbitkv_proto::NamespaceDescriptor,
) -> Result<bool, Denied> {
    let uid = exec
        .shared
        .sessions
        .lock()
        .expect("session table lock is never poisoned")
        .get(&session)
        .map_or(u32::MAX, |s| s.uid);
    exec.shared.namespace_owners.claim(d.id(), &d.model, uid)
}

/// Forgets the owner a failed registration claimed.
fn unclaim_namespace(exec: &Exec, id: u64, claimed: bool) {
    exec.shared.namespace_owners.release(id, claimed);
}

/// Bounds and state checks that need no shard.
fn check(exec: &Exec, counters: &SessionCounters, r: &Request) -> Result<(), (ErrorCode, String)> {
    let cfg = &exec.shared.settings.config;
    let n = r.key_count() as u64;
    if n > cfg.max_keys_per_request as u64 {
        return Err((
            ErrorCode::TooLarge,
            format!("{n} keys exceed --max-keys-per-request {}", cfg.max_keys_per_request),
        ));
    }
    // Keys of one request mostly share a namespace: look each namespace up once in a row.
    let mut allowed = None;
    let refused = r.find_key(|k| {
        if allowed == Some(k.namespace) {
            return false;
        }
        let ok = counters.registered(k.namespace);
        allowed = ok.then_some(k.namespace);
        !ok
    });
    if let Some(key) = refused {
        return Err((
            ErrorCode::UnknownNamespace,
            format!(
                "namespace {:#018x} is not registered by this session: register it first",
                key.namespace
            ),
        ));
    }
    let result = check_bounds(exec, counters, r, n);
    // Take the budget now, before any await: concurrent requests of the session then see it.
    // `execute` hands back what was not used.
    if result.is_ok() {
        match r {
            Request::Reserve { .. } => counters.add_reservations(n as i64),
            Request::Lookup { lease: true, .. } => counters.add_leases(n as i64),
            Request::Save { .. } => counters.add_reservations(n as i64),
            Request::Load { .. } => counters.add_leases(n as i64),
            _ => {}
        }
    }
    result
}

fn check_bounds(
    exec: &Exec,
    counters: &SessionCounters,
    r: &Request,
    n: u64,
) -> Result<(), (ErrorCode, String)> {
    let cfg = &exec.shared.settings.config;
    match r {
        // A save reserves its chunks like a reserve does.
        Request::Reserve { .. } | Request::Save { .. } => {
            if let Request::Reserve { keys, lens } = r {
                if keys.len() != lens.len() {
                    return Err((
                        ErrorCode::Malformed,
                        format!("reserve has {} keys but {} lengths", keys.len(), lens.len()),
                    ));
                }
            }
            if exec.shared.state() == ServeState::Draining {
                return Err((ErrorCode::Draining, "server is draining: writes are refused".into()));
            }
            if counters.reservations() + n > cfg.max_reservations_per_session {
                return Err((
                    ErrorCode::LeaseLimit,
                    format!(
                        "session holds {} reservations; {n} more exceed \
                         --max-reservations-per-session {}",
                        counters.reservations(),
                        cfg.max_reservations_per_session
                    ),
                ));
            }
        }
        Request::Lookup { lease: true, .. } | Request::Load { .. }
            if counters.leases() + n > cfg.max_leases_per_session =>
        {
            return Err((
                ErrorCode::LeaseLimit,
                format!(
                    "session holds {} leases; {n} more exceed --max-leases-per-session {}",
                    counters.leases(),
                    cfg.max_leases_per_session
                ),
            ));
        }
        Request::RegisterNamespace { descriptor } => {
            descriptor.validate().map_err(|e| (ErrorCode::InvalidArgument, e.to_string()))?;
        }
        Request::CommitChecked { slots, checksums } if slots.len() != checksums.len() => {
            return Err((
                ErrorCode::Malformed,
                format!(
                    "commit_checked has {} slots but {} checksums: give one per slot",
                    slots.len(),
                    checksums.len()
                ),
            ));
        }
        _ => {}
    }
    Ok(())
}

/// Executes one request of `session` on this shard. One arm per request kind, each a call or
/// two: the dispatch reads best whole, so it stays one function past the usual length.
async fn execute(
    exec: &Rc<Exec>,
    session: SessionId,
    counters: &SessionCounters,
    request: Request,
) -> Response {
    match request {
        Request::Ping => Response::Pong,
        Request::RegisterNamespace { descriptor } => {
            let id = descriptor.id();
            let claimed = match claim_namespace(exec, session, &descriptor) {
                Ok(claimed) => claimed,
                Err(why) => return Response::error(ErrorCode::PermissionDenied, why.to_string()),
            };
            let mut max = 0;
            for shard in 0..exec.shards {
                let op = ShardOp::Register { descriptor: descriptor.clone() };
                match exec.exec_on(shard, op).await {
                    ShardReply::Registered(Ok(m)) => max = m,
                    ShardReply::Registered(Err((code, message))) => {
                        unclaim_namespace(exec, id, claimed);
                        return Response::Error { code, message };
                    }
                    other => {
                        unclaim_namespace(exec, id, claimed);
                        return internal(shard, &other);
                    }
                }
            }
            counters.add_namespace(id);
            Response::Registered { namespace: id, max_chunk_bytes: max }
        }
        Request::Lookup { keys, lease } => {
            let hits = lookup(exec, session, &keys, lease).await;
            let prefix = hits.iter().position(Option::is_none).unwrap_or(hits.len());
            if lease {
                // Hits past the first miss were leased by their shards; give them back.
                let extra: Vec<SlotRef> = keys[prefix..]
                    .iter()
                    .zip(&hits[prefix..])
                    .filter_map(|(key, h)| {
                        h.map(|h| SlotRef { key: *key, generation: h.generation })
                    })
                    .collect();
                if !extra.is_empty() {
                    per_slot(exec, &extra, |slots| ShardOp::Release { session, slots }).await;
                }
                // The whole key count was charged at dispatch; keep only the leased prefix.
                counters.add_leases(prefix as i64 - keys.len() as i64);
            }
            let hits: Vec<Hit> = hits
                .into_iter()
                .take(prefix)
                .map(|h| h.expect("inside the prefix every key hit"))
                .collect();
            Response::Lookup { hits }
        }
        Request::Reserve { keys, lens } => {
            let items: Vec<(ChunkKey, u64)> = keys.into_iter().zip(lens).collect();
            let slots = reserve(exec, session, &items).await;
            let made = slots.iter().filter(|s| matches!(s, Reservation::Slot { .. })).count();
            counters.add_reservations(made as i64 - slots.len() as i64);
            Response::Reserved { slots }
        }
        Request::Commit { slots } => {
            let o = per_slot(exec, &slots, |slots| ShardOp::Commit { session, slots }).await;
            counters.add_reservations(-(done(&o) as i64));
            Response::Outcomes { outcomes: o }
        }
        Request::CommitChecked { slots, checksums } => {
            let o = commit_given(
                exec,
                session,
                &slots,
                &checksums,
                Check::First,
                OnWrongChecksum::HashRest,
            )
            .await;
            // A reservation whose checksum was wrong is dropped, like a committed one gone.
            let gone = o
                .iter()
                .filter(|o| {
                    matches!(
                        o,
                        ChunkOutcome::Done | ChunkOutcome::Failed(ErrorCode::ChecksumMismatch)
                    )
                })
                .count();
            counters.add_reservations(-(gone as i64));
            Response::Outcomes { outcomes: o }
        }
        Request::Abort { slots } => {
            let o = per_slot(exec, &slots, |slots| ShardOp::Abort { session, slots }).await;
            counters.add_reservations(-(done(&o) as i64));
            Response::Outcomes { outcomes: o }
        }
        Request::Release { slots } => {
            let o = per_slot(exec, &slots, |slots| ShardOp::Release { session, slots }).await;
            counters.add_leases(-(done(&o) as i64));
            Response::Outcomes { outcomes: o }
        }
        Request::Evict { keys } => {
            let o =
                scatter(exec, &keys, |k| k, |keys| ShardOp::Evict { keys }, outcomes, FAILED).await;
            Response::Outcomes { outcomes: o }
        }
        Request::RegisterGpu { device_uuid, layout, tensors } => {
            crate::requests::transfer::register(exec, session, device_uuid, layout, tensors).await
        }
        Request::UnregisterGpu { registration, generation } => {
            crate::requests::transfer::unregister(exec, session, registration, generation).await
        }
        Request::Save { registration, generation, keys, blocks } => {
            let n = keys.len() as i64;
            let r = crate::requests::transfer::save(
                exec,
                session,
                registration,
                generation,
                keys,
                blocks,
            )
            .await;
            // Every reservation charged at dispatch is committed or aborted by now.
            counters.add_reservations(-n);
            r
        }
        Request::Load { registration, generation, keys, blocks } => {
            let n = keys.len() as i64;
            let r = crate::requests::transfer::load(
                exec,
                session,
                registration,
                generation,
                keys,
                blocks,
            )
            .await;
            // Every lease charged at dispatch is released by now.
            counters.add_leases(-n);
            r
        }
    }
}

fn done(o: &[ChunkOutcome]) -> usize {
    o.iter().filter(|o| **o == ChunkOutcome::Done).count()
}

fn internal(shard: usize, reply: &ShardReply) -> Response {
    tracing::error!(shard, ?reply, "unexpected shard reply");
    Response::error(ErrorCode::Internal, format!("shard {shard} answered unexpectedly"))
}
