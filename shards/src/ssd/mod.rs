//! The SSD tier of one shard: its file format and region log.

pub mod format;
pub mod log;
pub mod ring;
pub mod store;
