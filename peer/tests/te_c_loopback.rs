//! Real bytes through Mooncake Transfer Engine's C API (`mooncake-sys`) on loopback TCP, from
//! the TE build named by `ORBITKV_TE_LIBRARY` (skipped, saying so, without one: no published
//! package ships TE's C API; docs/cluster.md says how to build it): two engines read and write
//! each other's memory exactly, in batches larger than TE's queue; a local range outside the
//! registered memory, a range outside the peer's and a peer that is gone are errors, not
//! hangs. With feature `te-python` too, an engine of each route reads the other's memory (the
//! two routes interoperate in one cluster).
//!
//! What needs no TE build runs always: a library that is not there, or is not TE, is refused
//! naming it.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{assert_scattered, pattern, scattered, Mapping, MIB, PIECE};
use orbitkv_peer::te_c::{self, TeCError, TeTransport, TransferEngine};

fn library() -> Option<PathBuf> {
    match std::env::var_os("ORBITKV_TE_LIBRARY") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            eprintln!("skipped: ORBITKV_TE_LIBRARY names no Transfer Engine C API library");
            None
        }
    }
}

#[test]
fn a_library_that_is_missing_or_not_te_is_refused_by_name() {
    let err = te_c::load(Path::new("/nonexistent/libtransfer_engine.so")).unwrap_err();
    assert!(matches!(err, TeCError::Load { .. }), "{err}");
    assert!(err.to_string().contains("/nonexistent/libtransfer_engine.so"), "{err}");
    let err = te_c::load(Path::new("libc.so.6")).unwrap_err();
    assert!(err.to_string().contains("libc.so.6"), "{err}");
    assert!(err.to_string().contains("createTransferEngine"), "{err}");
}

#[test]
fn two_engines_read_and_write_each_others_memory_exactly() {
    let Some(lib) = library() else { return };
    let api = te_c::load(&lib).unwrap();
    let (mut a_mem, mut b_mem) = (Mapping::new(64 * MIB), Mapping::new(64 * MIB));
    let want = pattern(64 * MIB, 7);
    a_mem.bytes().copy_from_slice(&want);
    // One engine with TE's own choice of transport (TCP on a host without RDMA devices), one
    // with TCP asked for.
    let a = TransferEngine::new(Arc::clone(&api), "127.0.0.1", TeTransport::Auto).unwrap();
    let b = TransferEngine::new(Arc::clone(&api), "127.0.0.1", TeTransport::Tcp).unwrap();
    assert_ne!(a.segment(), b.segment());
    a.register(a_mem.addr(), 64 * MIB as u64).unwrap();
    b.register(b_mem.addr(), 64 * MIB as u64).unwrap();

    // One read of 48 MiB from an offset.
    let one = [(b_mem.addr(), a_mem.addr() + MIB as u64, 48 * MIB as u64)];
    b.read_many(a.segment(), &one).unwrap();
    assert!(b_mem.bytes()[..48 * MIB] == want[MIB..49 * MIB], "the read's bytes differ");
    // Nothing to read: over at once.
    b.read_many(a.segment(), &[]).unwrap();
    assert!(matches!(b.start_read(a.segment(), &[]).unwrap().poll(), Some(Ok(()))));

    // Many 32 KiB pieces, more than one batch's worth (1024), scattered.
    let ranges = scattered(&b_mem, &a_mem);
    b.read_many(a.segment(), &ranges).unwrap();
    assert_scattered(&mut b_mem, &a_mem, &want, &ranges);

    // Followed without blocking, as the peer thread does: the ranges landed grow to all of
    // them; a range that fails stops them.
    let landed = |ranges: &[(u64, u64, u64)]| {
        let mut t = b.start_read(a.segment(), ranges).unwrap();
        let mut counts = vec![t.landed()];
        loop {
            let over = t.poll();
            if t.landed() != *counts.last().unwrap() {
                counts.push(t.landed());
            }
            if let Some(result) = over {
                return (result, counts);
            }
            std::thread::yield_now();
        }
    };
    b_mem.bytes()[..ranges.len() * PIECE].fill(0);
    let (result, counts) = landed(&ranges);
    result.unwrap();
    assert!(counts.windows(2).all(|w| w[0] < w[1]), "counts go back: {counts:?}");
    assert_eq!(counts.last(), Some(&ranges.len()));
    assert!(counts.len() > 2, "{counts:?}");
    assert_scattered(&mut b_mem, &a_mem, &want, &ranges);
    let mut bad = ranges[..8].to_vec();
    bad[5].1 = a_mem.addr() + 64 * MIB as u64; // outside the peer's memory
    let (result, counts) = landed(&bad);
    result.unwrap_err();
    assert!(counts.iter().all(|&n| n <= 5), "counted past the failed range: {counts:?}");

    // A write the other way.
    let back = pattern(8 * MIB, 9);
    b_mem.bytes()[..8 * MIB].copy_from_slice(&back);
    let write = [(b_mem.addr(), a_mem.addr() + 32 * MIB as u64, 8 * MIB as u64)];
    b.write_many(a.segment(), &write).unwrap();
    assert!(a_mem.bytes()[32 * MIB..40 * MIB] == back[..], "the write's bytes differ");

    // A peer that left the cluster is looked up afresh at the next transfer (an engine back at
    // its address is another one): the read still lands right.
    assert!(b.is_open(a.segment()));
    b.forget_segment(a.segment());
    assert!(!b.is_open(a.segment()));
    b.read_many(a.segment(), &one).unwrap();
    assert!(b.is_open(a.segment()));
    assert!(b_mem.bytes()[..48 * MIB] == a_mem.bytes()[MIB..49 * MIB], "the read after differs");

    // A local range outside what is registered here: refused before TE is asked.
    let stray = [(b_mem.addr() + 64 * MIB as u64 - 4096, a_mem.addr(), 8192)];
    let err = b.read_many(a.segment(), &stray).unwrap_err();
    assert!(matches!(err, TeCError::NotRegistered { len: 8192, .. }), "{err}");

    // Outside the peer's registered memory: an error, nothing written.
    b_mem.bytes()[..4096].fill(0xAB);
    let outside = [(b_mem.addr(), a_mem.addr() + 64 * MIB as u64, 4096)];
    let err = b.read_many(a.segment(), &outside).unwrap_err();
    assert!(matches!(err, TeCError::Transfer { .. } | TeCError::Failed { .. }), "{err}");
    assert!(b_mem.bytes()[..4096].iter().all(|&x| x == 0xAB), "a refused read wrote");
    // The engine still reads after that, the peer's description fetched afresh (what A holds
    // now: the write above included).
    b.read_many(a.segment(), &one).unwrap();
    assert!(b_mem.bytes()[..48 * MIB] == a_mem.bytes()[MIB..49 * MIB], "the re-read differs");

    // A peer that is gone: an error at once.
    let c = TransferEngine::new(Arc::clone(&api), "127.0.0.1", TeTransport::Auto).unwrap();
    let gone = c.segment().to_string();
    drop(c);
    let err = b.read_many(&gone, &[(b_mem.addr(), 0, 4096)]).unwrap_err();
    assert!(matches!(err, TeCError::Transfer { .. } | TeCError::Failed { .. }), "{err}");
}

/// The C API's engine and the wheel's engine read each other's memory.
#[cfg(feature = "te-python")]
#[test]
fn the_c_and_the_python_routes_read_each_other() {
    let Some(lib) = library() else { return };
    let api = te_c::load(&lib).unwrap();
    let (mut c_mem, mut py_mem) = (Mapping::new(16 * MIB), Mapping::new(16 * MIB));
    let (c_data, py_data) = (pattern(16 * MIB, 3), pattern(16 * MIB, 5));
    c_mem.bytes().copy_from_slice(&c_data);
    py_mem.bytes().copy_from_slice(&py_data);
    let c = TransferEngine::new(api, "127.0.0.1", TeTransport::Auto).unwrap();
    let py = orbitkv_peer::te::TransferEngine::new("127.0.0.1", "tcp").unwrap();
    c.register(c_mem.addr(), 16 * MIB as u64).unwrap();
    py.register(py_mem.addr(), 16 * MIB as u64).unwrap();
    // The C engine reads the wheel engine's first half into its second half.
    let half = 8 * MIB as u64;
    c.read_many(py.segment(), &[(c_mem.addr() + half, py_mem.addr(), half)]).unwrap();
    assert!(c_mem.bytes()[8 * MIB..] == py_data[..8 * MIB], "C read from Python differs");
    // The wheel's engine reads the C engine's first half into its second half.
    py.read_many(c.segment(), &[(py_mem.addr() + half, c_mem.addr(), half)]).unwrap();
    assert!(py_mem.bytes()[8 * MIB..] == c_data[..8 * MIB], "Python read from C differs");
}
