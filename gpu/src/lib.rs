//! `orbitkv-gpu`: CUDA for OrbitKV through cudarc with dynamic loading. Builds and runs on
//! machines without CUDA and says so clearly.
//!
//! Whether the server uses a GPU (`--gpu auto|off|required`), the devices (identified by
//! UUID), the engine KV layouts (where a block's bytes lie), registration of the arena, and
//! the copy engines that move pages between engine GPU memory and arena slots ([`dma`]).

#![deny(unsafe_code)]

mod detect;
pub mod dma;
mod layout;
mod mode;
mod register;

pub use detect::{probe, DeviceInfo, Probe};
pub use layout::{LayoutError, LayoutGeometry, Segment};
pub use mode::{resolve, GpuError, GpuMode};
pub use register::{register_host, register_host_parts, HostRegistration, RegisterPart};
