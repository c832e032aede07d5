//! `orbitkv-server`: the per-host OrbitKV Manager (see the library's docs).

fn main() -> std::process::ExitCode {
    orbitkv_server::main()
}
