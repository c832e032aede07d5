//! The control plane: the state shards read (`shared`), the start's progress (`startup`), who
//! may connect (`access`), the engine socket (`bootstrap`), the admin socket (`admin`), and
//! the shards as the peer thread sees them (`peering`).

pub(crate) mod access;
pub(crate) mod admin;
pub(crate) mod bootstrap;
pub(crate) mod peering;
pub(crate) mod shared;
pub(crate) mod startup;
