//! `orbitkv-gpu`: CUDA for OrbitKV through cudarc with dynamic loading. Builds and runs on
//! machines without CUDA and says so clearly.
//!
//! This first part decides whether the server uses a GPU (`--gpu auto|off|required`) and
//! describes the devices (identified by UUID). Registration of the arena, imported engine
//! allocations and the copy engines come next (see the issue on GPU save/load).

#![deny(unsafe_code)]

mod detect;
mod mode;

pub use detect::{probe, DeviceInfo, Probe};
pub use mode::{resolve, GpuError, GpuMode};
