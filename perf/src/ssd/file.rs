//! The test file of `ssd`: `DIR/orbitkv-perf-ssd.dat`, preallocated and filled once, then
//! reused by later runs; opened O_DIRECT for the benchmark.
//!
//! Filled means every byte of the first `--file-size` bytes was written: a preallocated but
//! never-written range is an unwritten extent, which reads as zeroes without touching the
//! device (reads would be measured far too fast) and whose first write converts the extent
//! (writes would pay a cost that fio, run afterwards on the same file, would not). A small
//! marker file next to it records how many bytes a completed fill covered, so that a fill
//! interrupted halfway is redone.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use nix::fcntl::{fallocate, posix_fadvise, FallocateFlags, OFlag, PosixFadviseAdvice};
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

use crate::error::{invalid, Error};

/// Name of the test file in `--dir`.
pub(crate) const FILE_NAME: &str = "orbitkv-perf-ssd.dat";
/// Name of the marker that says how many bytes of the test file a completed fill wrote.
const MARKER_NAME: &str = "orbitkv-perf-ssd.dat.filled";
/// Bytes per buffered write of the fill pass.
const FILL_CHUNK: usize = 8 << 20;

/// The test file, ready for O_DIRECT I/O over its first `size` bytes.
#[derive(Debug)]
pub(crate) struct TestFile {
    /// Its path.
    pub path: PathBuf,
    /// Opened read-write with O_DIRECT.
    pub direct: File,
    /// What preparing it took.
    pub prepared: Prepared,
}

/// What [`prepare`] had to do.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Prepared {
    /// The file did not exist.
    pub created: bool,
    /// Seconds spent filling it; `None` when an earlier run's fill covered the size.
    pub fill_s: Option<f64>,
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io { op, path: path.to_owned(), source }
}

/// Makes `dir/orbitkv-perf-ssd.dat` at least `size` bytes, every one of them written, and
/// opens it O_DIRECT. Problems with the directory are errors naming `--dir`, lack of space
/// names `--file-size`.
pub(crate) fn prepare(dir: &Path, size: u64) -> Result<TestFile, Error> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(invalid("--dir", format!("{} is not a directory", dir.display()))),
        Err(e) => return Err(invalid("--dir", format!("{}: {e}", dir.display()))),
    }
    let path = dir.join(FILE_NAME);
    let marker = dir.join(MARKER_NAME);
    let created = !path.exists();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| {
        invalid("--dir", format!("cannot create or open {}: {e}", path.display()))
    })?;
    let len = file.metadata().map_err(io("stat", &path))?.len();
    if len < size {
        // The grown part is unwritten: no earlier fill covers the file any more.
        remove_marker(&marker)?;
        let end = libc_off(size, "--file-size")?;
        fallocate(&file, FallocateFlags::empty(), 0, end).map_err(|e| {
            invalid(
                "--file-size",
                format!("cannot preallocate {size} bytes for {}: {e}", path.display()),
            )
        })?;
    }
    let fill_s = if filled_bytes(&marker) >= size {
        None
    } else {
        let started = Instant::now();
        fill(&file, &path, size)?;
        write_marker(&marker, size)?;
        Some(started.elapsed().as_secs_f64())
    };
    drop(file);
    let direct = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(OFlag::O_DIRECT.bits())
        .open(&path)
        .map_err(|e| {
            invalid(
                "--dir",
                format!(
                    "cannot open {} with O_DIRECT ({e}); use a directory on a file system \
                     that supports it (not tmpfs)",
                    path.display()
                ),
            )
        })?;
    Ok(TestFile { path, direct, prepared: Prepared { created, fill_s } })
}

fn libc_off(v: u64, flag: &'static str) -> Result<i64, Error> {
    i64::try_from(v).map_err(|_| invalid(flag, format!("{v} bytes is beyond a file offset")))
}

/// Bytes a completed fill wrote, per the marker; 0 when there is none (or it is unreadable).
fn filled_bytes(marker: &Path) -> u64 {
    std::fs::read_to_string(marker).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

fn write_marker(marker: &Path, size: u64) -> Result<(), Error> {
    std::fs::write(marker, format!("{size}\n")).map_err(io("writing", marker))
}

fn remove_marker(marker: &Path) -> Result<(), Error> {
    match std::fs::remove_file(marker) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io("removing", marker)(e)),
        _ => Ok(()),
    }
}

/// Writes pseudo-random bytes over `[0, size)` (buffered, then synced and dropped from the
/// page cache: the benchmark reads the device, not cached pages).
fn fill(file: &File, path: &Path, size: u64) -> Result<(), Error> {
    let mut rng = SmallRng::seed_from_u64(size);
    let mut chunk = vec![0u8; FILL_CHUNK];
    let mut w: &File = file;
    let mut left = size;
    while left > 0 {
        rng.fill_bytes(&mut chunk);
        let n = left.min(FILL_CHUNK as u64) as usize;
        w.write_all(&chunk[..n]).map_err(io("filling", path))?;
        left -= n as u64;
    }
    w.flush().map_err(io("filling", path))?;
    file.sync_all().map_err(io("syncing", path))?;
    // Advice only: a failure leaves clean cached pages, which O_DIRECT reads ignore anyway.
    let _ = posix_fadvise(file, 0, 0, PosixFadviseAdvice::POSIX_FADV_DONTNEED);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_filled_once_and_refilled_when_it_grows() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let first = prepare(dir.path(), 1 << 20).unwrap();
        assert!(first.prepared.created);
        assert!(first.prepared.fill_s.is_some());
        assert_eq!(first.direct.metadata().unwrap().len(), 1 << 20);
        let bytes = std::fs::read(&first.path).unwrap();
        assert!(bytes.iter().filter(|b| **b == 0).count() < bytes.len() / 100);

        let again = prepare(dir.path(), 1 << 20).unwrap();
        assert_eq!(again.prepared, Prepared { created: false, fill_s: None });
        let smaller = prepare(dir.path(), 1 << 19).unwrap();
        assert_eq!(smaller.prepared.fill_s, None);

        let grown = prepare(dir.path(), 2 << 20).unwrap();
        assert!(grown.prepared.fill_s.is_some());
        assert_eq!(filled_bytes(&dir.path().join(MARKER_NAME)), 2 << 20);
    }

    #[test]
    fn a_missing_or_file_dir_names_the_flag() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let missing = dir.path().join("nope");
        let e = prepare(&missing, 4096).unwrap_err().to_string();
        assert!(e.contains("--dir") && e.contains("nope"), "{e}");
        let file = dir.path().join("plain");
        std::fs::write(&file, b"x").unwrap();
        let e = prepare(&file, 4096).unwrap_err().to_string();
        assert!(e.contains("--dir") && e.contains("not a directory"), "{e}");
    }
}
