//! `orbitkv-gpu`: CUDA for OrbitKV through cudarc with dynamic loading. Builds and runs on
//! machines without CUDA and says so clearly.
//!
//! So far: whether the server uses a GPU (`--gpu auto|off|required`), the devices (identified
//! by UUID), and the engine KV layouts (where a block's bytes lie). Registration of the arena,
//! imported engine allocations and the copy engines come next.

#![deny(unsafe_code)]

mod detect;
mod layout;
mod mode;
mod register;

pub use detect::{probe, DeviceInfo, Probe};
pub use layout::{KvLayout, LayoutDesc, LayoutError, Segment};
pub use mode::{resolve, GpuError, GpuMode};
pub use register::{register_arena, HostRegistration};
