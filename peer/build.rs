//! With `te-python`, this crate embeds an interpreter and so links libpython. The workspace
//! sets `PYO3_BUILD_EXTENSION_MODULE` for `orbitkv-py` (an extension module, which must not link
//! it), which also stops pyo3 from linking it here: name the library ourselves.
//!
//! The protobufs are not compiled here: their generated code is checked in (`src/generated/`,
//! kept in step by `tests/generated_protos.rs`), so building needs no `protoc`.

fn main() {
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
