//! An engine's requests on their home shard: the dispatch and every request but GPU copies
//! (`router`), GPU saves and loads (`transfer`), and the fan-out of a request's keys to their
//! shards that both use (`fanout`).

pub(crate) mod fanout;
pub(crate) mod router;
pub(crate) mod transfer;
