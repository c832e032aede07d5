//! `cargo fuzz run admin_request`: an admin socket request line, as the server decodes it (`orbitkv_proto::admin::AdminRequestLine`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| orbitkv_fuzz::admin_request(data));
