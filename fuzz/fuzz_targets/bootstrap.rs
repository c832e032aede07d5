//! `cargo fuzz run bootstrap`: see `orbitkv_fuzz::bootstrap`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| orbitkv_fuzz::bootstrap(data));
