//! `cargo fuzz run ssd_recovery`: see `orbitkv_fuzz::ssd_recovery`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| orbitkv_fuzz::ssd_recovery(data));
