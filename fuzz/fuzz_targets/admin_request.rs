//! `cargo fuzz run admin_request`: an admin socket request line, as the server decodes it (`orbitkv_proto::parse_admin_request`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| orbitkv_fuzz::admin_request(data));
