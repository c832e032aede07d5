//! `peer/src/generated/` is checked in so that building OrbitKV needs no `protoc`: this test
//! compiles `peer/proto/` again (with the `protoc` that `protoc-bin-vendored` ships, and the
//! tonic/prost generators of Cargo.lock) and fails when the result differs from what is
//! checked in. After changing a `.proto` file, or tonic or prost, run it with
//! `ORBITKV_BLESS=1` to rewrite the generated files, and commit them.

use std::path::{Path, PathBuf};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Compiles both protobuf packages into `out`.
fn generate(out: &Path) {
    let protoc = protoc_bin_vendored::protoc_bin_path()
        .expect("protoc-bin-vendored has a protoc for this host");
    let proto = crate_dir().join("proto");
    let config = || {
        let mut c = tonic_prost_build::Config::new();
        c.protoc_executable(&protoc);
        c
    };
    // The peer control RPC: both sides.
    tonic_prost_build::configure()
        .out_dir(out)
        .emit_rerun_if_changed(false)
        .compile_with_config(
            config(),
            &[proto.join("orbitkv/peer/v1/peer.proto")],
            std::slice::from_ref(&proto),
        )
        .expect("compiling peer.proto");
    // etcd's API: OrbitKV is only its client.
    tonic_prost_build::configure()
        .out_dir(out)
        .emit_rerun_if_changed(false)
        .build_server(false)
        .compile_with_config(
            config(),
            &[proto.join("etcd/etcdserverpb.proto")],
            std::slice::from_ref(&proto),
        )
        .expect("compiling etcdserverpb.proto");
}

#[test]
fn generated_code_matches_the_proto_files() {
    let fresh = tempfile::tempdir().expect("a temporary directory");
    generate(fresh.path());
    let checked_in = crate_dir().join("src/generated");
    let bless = std::env::var_os("ORBITKV_BLESS").is_some();
    let mut stale = Vec::new();
    for name in ["orbitkv.peer.v1.rs", "etcdserverpb.rs"] {
        let new = std::fs::read_to_string(fresh.path().join(name)).expect("generated");
        let path = checked_in.join(name);
        let old = std::fs::read_to_string(&path).unwrap_or_default();
        if new != old {
            if bless {
                std::fs::write(&path, &new).expect("writing the generated file");
            } else {
                stale.push(path.display().to_string());
            }
        }
    }
    // Nothing else generated: a new .proto file needs a line above.
    let mut produced: Vec<String> = std::fs::read_dir(fresh.path())
        .expect("listing")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    produced.sort();
    assert_eq!(produced, ["etcdserverpb.rs", "orbitkv.peer.v1.rs"]);
    assert!(
        stale.is_empty(),
        "these differ from what peer/proto compiles to: {}; run \
         `ORBITKV_BLESS=1 cargo test -p orbitkv-peer --test generated_protos` and commit them",
        stale.join(", ")
    );
}
