//! `cargo fuzz run config_file`: a config file's text, as the server decodes it (`orbitkv_fuzz::config_file`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| orbitkv_fuzz::config_file(data));
