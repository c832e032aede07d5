//! Compiles the peer control RPC's protobufs. With `te-python`, this crate embeds an interpreter and so links libpython. The workspace
//! sets `PYO3_BUILD_EXTENSION_MODULE` for `orbitkv-py` (an extension module, which must not link
//! it), which also stops pyo3 from linking it here: name the library ourselves.

fn main() {
    // The peer control RPC (tonic; needs protoc, as etcd-client does).
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure()
        .compile_protos(&["proto/orbitkv/peer/v1/peer.proto"], &["proto"])
        .expect("compiling proto/orbitkv/peer/v1/peer.proto (is protoc installed?)");
    #[cfg(feature = "te-python")]
    {
        let cfg = pyo3_build_config::get();
        if let Some(dir) = cfg.lib_dir() {
            println!("cargo:rustc-link-search=native={dir}");
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
        match cfg.lib_name() {
            Some(name) => println!("cargo:rustc-link-lib={name}"),
            None => panic!("te-python: pyo3 found no libpython to link (set PYO3_PYTHON)"),
        }
    }
}
