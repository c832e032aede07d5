//! `cargo fuzz run peer_messages`: see `orbitkv_fuzz::peer_messages`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| orbitkv_fuzz::peer_messages(data));
