//! A shard executor: its state and what handlers do with it (`context`), its loop
//! (`executor`), the messages on its control queue (`messages`), its doorbell (`doorbell`) and
//! the iceoryx2 services its sessions talk through (`ipc`).

pub(crate) mod context;
pub(crate) mod doorbell;
pub(crate) mod executor;
pub(crate) mod ipc;
pub(crate) mod messages;
