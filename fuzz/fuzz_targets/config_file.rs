//! `cargo fuzz run config_file`: a config file's text, as the server decodes it (`orbitkv_server::fuzzing::config_file`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| orbitkv_server::fuzzing::config_file(data));
