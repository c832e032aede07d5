//! `cargo fuzz run ssd_blocks`: see `orbitkv_fuzz::ssd_blocks`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| orbitkv_fuzz::ssd_blocks(data));
