//! `cargo fuzz run request`: see `orbitkv_fuzz::request`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| orbitkv_fuzz::request(data));
