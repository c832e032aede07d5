//! A client of etcd's v3 gRPC API, as much of it as membership uses: single-key and prefix
//! reads, deletes, transactions, and leases (grant, revoke, keep-alive). The messages are
//! generated from `proto/etcd/etcdserverpb.proto` (a subset of etcd's API, same wire format)
//! into `src/generated/`, so building needs no `protoc`.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

#[allow(missing_docs, clippy::all)]
pub(crate) mod pb {
    include!("generated/etcdserverpb.rs");
}

use pb::compare::{CompareResult, CompareTarget, TargetUnion};
use pb::kv_client::KvClient;
use pb::lease_client::LeaseClient;
use pb::{request_op, Compare, KeyValue, RequestOp, TxnRequest, TxnResponse};

/// Why an etcd call failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EtcdError {
    /// An endpoint that is not a URL (the operator's input).
    #[error("{0}")]
    InvalidEndpoint(String),
    /// No connection could be made.
    #[error("{0}")]
    Connect(String),
    /// etcd, or the transport under the call, answered with an error.
    #[error("{}: {}", .0.code(), .0.message())]
    Status(Box<tonic::Status>),
    /// etcd answered, but not as its API says.
    #[error("{0}")]
    Protocol(String),
}

impl From<tonic::Status> for EtcdError {
    fn from(s: tonic::Status) -> Self {
        EtcdError::Status(Box::new(s))
    }
}

/// An error and its causes, on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// A connection to an etcd cluster.
pub(crate) struct Etcd {
    kv: KvClient<Channel>,
    lease: LeaseClient<Channel>,
}

impl Etcd {
    /// Connects to `endpoints` (`http://host:port`); each call may take at most `timeout`. One
    /// endpoint is connected at once (so an unreachable etcd is reported here); several are
    /// balanced, each connected when first used.
    pub(crate) async fn connect(
        endpoints: &[String],
        timeout: Duration,
    ) -> Result<Self, EtcdError> {
        let mut list = Vec::with_capacity(endpoints.len());
        for e in endpoints {
            let ep = Endpoint::from_shared(e.clone())
                .map_err(|err| EtcdError::InvalidEndpoint(format!("{e:?}: {}", chain(&err))))?
                .connect_timeout(timeout)
                .timeout(timeout);
            list.push(ep);
        }
        let channel = match list.len() {
            0 => return Err(EtcdError::InvalidEndpoint("no endpoint given".into())),
            1 => list.remove(0).connect().await.map_err(|e| EtcdError::Connect(chain(&e)))?,
            _ => Channel::balance_list(list.into_iter()),
        };
        Ok(Etcd { kv: KvClient::new(channel.clone()), lease: LeaseClient::new(channel) })
    }

    /// The key's value, if it exists.
    pub(crate) async fn get(&mut self, key: &str) -> Result<Option<KeyValue>, EtcdError> {
        let req = pb::RangeRequest { key: key.into(), range_end: Vec::new() };
        Ok(self.kv.range(req).await?.into_inner().kvs.into_iter().next())
    }

    /// Every key under `prefix`, in key order.
    pub(crate) async fn get_prefix(&mut self, prefix: &str) -> Result<Vec<KeyValue>, EtcdError> {
        let req = pb::RangeRequest { key: prefix.into(), range_end: prefix_end(prefix.as_bytes()) };
        Ok(self.kv.range(req).await?.into_inner().kvs)
    }

    /// Deletes one key; the number of keys deleted (0 or 1).
    pub(crate) async fn delete(&mut self, key: &str) -> Result<i64, EtcdError> {
        let req = pb::DeleteRangeRequest { key: key.into(), range_end: Vec::new() };
        Ok(self.kv.delete_range(req).await?.into_inner().deleted)
    }

    /// Runs a transaction.
    pub(crate) async fn txn(&mut self, txn: TxnRequest) -> Result<TxnResponse, EtcdError> {
        Ok(self.kv.txn(txn).await?.into_inner())
    }

    /// A new lease of `ttl_s` seconds; its id.
    pub(crate) async fn lease_grant(&mut self, ttl_s: i64) -> Result<i64, EtcdError> {
        let r = self.lease.lease_grant(pb::LeaseGrantRequest { ttl: ttl_s, id: 0 }).await?;
        let r = r.into_inner();
        if !r.error.is_empty() {
            return Err(EtcdError::Protocol(format!("lease grant refused: {}", r.error)));
        }
        Ok(r.id)
    }

    /// Revokes a lease: the keys attached to it go at once.
    pub(crate) async fn lease_revoke(&mut self, id: i64) -> Result<(), EtcdError> {
        self.lease.lease_revoke(pb::LeaseRevokeRequest { id }).await?;
        Ok(())
    }

    /// Opens the keep-alive stream of lease `id` and sends its first keep-alive: the sender
    /// of the next ones, and the stream of etcd's answers (one per keep-alive).
    pub(crate) async fn lease_keep_alive(
        &mut self,
        id: i64,
    ) -> Result<(KeepAlive, tonic::Streaming<pb::LeaseKeepAliveResponse>), EtcdError> {
        let (tx, rx) = mpsc::channel(4);
        let keeper = KeepAlive { tx, id };
        // etcd answers the call (its headers) with the first reply, so one goes in first.
        keeper.keep_alive().await?;
        let replies = self.lease.lease_keep_alive(ReceiverStream::new(rx)).await?.into_inner();
        Ok((keeper, replies))
    }
}

/// Sends keep-alives of one lease on its open stream.
pub(crate) struct KeepAlive {
    tx: mpsc::Sender<pb::LeaseKeepAliveRequest>,
    id: i64,
}

impl KeepAlive {
    /// Sends one keep-alive.
    pub(crate) async fn keep_alive(&self) -> Result<(), EtcdError> {
        self.tx
            .send(pb::LeaseKeepAliveRequest { id: self.id })
            .await
            .map_err(|_| EtcdError::Connect("the keep-alive stream has ended".into()))
    }
}

/// The end of the key range of every key that starts with `prefix`: the prefix with its last
/// byte below 0xff incremented and what follows dropped (etcd's convention; `\0` where every
/// byte is 0xff, meaning "to the end").
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// Holds when `key` does not exist (its create revision is 0).
pub(crate) fn absent(key: &str) -> Compare {
    compare(key, CompareTarget::Create, TargetUnion::CreateRevision(0))
}

/// Holds when `key` was last modified at revision `rev`.
pub(crate) fn mod_revision_is(key: &str, rev: i64) -> Compare {
    compare(key, CompareTarget::Mod, TargetUnion::ModRevision(rev))
}

fn compare(key: &str, target: CompareTarget, value: TargetUnion) -> Compare {
    Compare {
        result: CompareResult::Equal as i32,
        target: target as i32,
        key: key.into(),
        target_union: Some(value),
    }
}

/// Puts `value` at `key`, attached to `lease` (0: none).
pub(crate) fn put(key: &str, value: &str, lease: i64) -> RequestOp {
    let put = pb::PutRequest { key: key.into(), value: value.into(), lease };
    RequestOp { request: Some(request_op::Request::RequestPut(put)) }
}

/// Reads `key`.
pub(crate) fn read(key: &str) -> RequestOp {
    let range = pb::RangeRequest { key: key.into(), range_end: Vec::new() };
    RequestOp { request: Some(request_op::Request::RequestRange(range)) }
}

/// The key-values of a transaction's first response, when that is a read.
pub(crate) fn first_read(done: &TxnResponse) -> Option<&[KeyValue]> {
    match done.responses.first()?.response.as_ref()? {
        pb::response_op::Response::ResponseRange(r) => Some(&r.kvs),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_follows_etcds_convention() {
        assert_eq!(prefix_end(b"/orbitkv/a/members/"), b"/orbitkv/a/members0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
        assert_eq!(prefix_end(b""), b"\0");
    }

    #[tokio::test]
    async fn endpoints_that_are_not_urls_are_named() {
        for bad in [vec![], vec!["http://[::1".to_string()]] {
            let err = match Etcd::connect(&bad, Duration::from_millis(100)).await {
                Err(e) => e,
                Ok(_) => panic!("{bad:?} connected"),
            };
            assert!(matches!(err, EtcdError::InvalidEndpoint(_)), "{bad:?}: {err}");
        }
        let err = match Etcd::connect(&["http://[::1".into()], Duration::from_millis(100)).await {
            Err(e) => e.to_string(),
            Ok(_) => unreachable!(),
        };
        assert!(err.contains("http://[::1"), "{err}");
    }

    #[tokio::test]
    async fn an_unreachable_etcd_is_a_connect_error() {
        // A port nothing listens on: bind one, then close it.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let url = format!("http://127.0.0.1:{port}");
        match Etcd::connect(&[url], Duration::from_secs(2)).await {
            Err(EtcdError::Connect(why)) => assert!(!why.is_empty()),
            Err(e) => panic!("not a connect error: {e}"),
            Ok(_) => panic!("connected to a closed port"),
        }
    }
}
