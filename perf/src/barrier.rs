//! A barrier between the ranks of `orbitkv-perf dma --barrier DIR`: each rank marks a phase
//! with a file `DIR/<phase>.<rank>` and waits until every rank's mark of that phase exists.
//! Processes of one host only; the folder is the caller's (a fresh one per group run).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::Error;

/// The ranks of one group meeting in a folder.
#[derive(Clone, Debug)]
pub(crate) struct Barrier {
    dir: PathBuf,
    rank: u32,
    world: u32,
    timeout: Duration,
}

impl Barrier {
    /// Rank `rank` of `world` meeting in `dir` (created when missing; a fresh one per group
    /// run: a mark this rank left in an earlier run is refused); a wait gives up after
    /// `timeout`.
    pub(crate) fn new(dir: &Path, rank: u32, world: u32, timeout: Duration) -> Result<Self, Error> {
        let folder =
            |e: std::io::Error| Error::Gpu(format!("barrier folder {}: {e}", dir.display()));
        std::fs::create_dir_all(dir).map_err(folder)?;
        let mine = format!(".{rank}");
        for entry in std::fs::read_dir(dir).map_err(folder)? {
            let name = entry.map_err(folder)?.file_name();
            if name.to_string_lossy().ends_with(&mine) {
                return Err(Error::Gpu(format!(
                    "barrier folder {} holds rank {rank}'s mark {name:?} of an earlier run: use \
                     a fresh folder",
                    dir.display()
                )));
            }
        }
        Ok(Self { dir: dir.to_path_buf(), rank, world, timeout })
    }

    /// Marks `phase` for this rank and waits for every other rank's mark.
    pub(crate) fn wait(&self, phase: &str) -> Result<(), Error> {
        let mark = |r: u32| self.dir.join(format!("{phase}.{r}"));
        std::fs::write(mark(self.rank), b"")
            .map_err(|e| Error::Gpu(format!("barrier mark {}: {e}", mark(self.rank).display())))?;
        let deadline = Instant::now() + self.timeout;
        loop {
            let missing: Vec<u32> = (0..self.world).filter(|&r| !mark(r).exists()).collect();
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Gpu(format!(
                    "barrier {phase:?} in {}: ranks {missing:?} did not arrive within {:?}",
                    self.dir.display(),
                    self.timeout
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_meet_and_a_missing_rank_is_named() {
        let dir = std::env::temp_dir().join(format!("orbitkv-barrier-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let t = Duration::from_secs(10);
        let mut b0 = Barrier::new(&dir, 0, 2, t).unwrap();
        let b1 = Barrier::new(&dir, 1, 2, t).unwrap();
        let other = std::thread::spawn(move || b1.wait("save"));
        b0.wait("save").unwrap();
        other.join().unwrap().unwrap();
        b0.timeout = Duration::from_millis(50);
        // Rank 1 never reaches "load": rank 0 gives up naming it.
        let e = b0.wait("load").unwrap_err().to_string();
        assert!(e.contains("\"load\"") && e.contains("[1]"), "{e}");
        // The folder now holds this run's marks: a new run there is refused.
        let e = Barrier::new(&dir, 0, 2, t).unwrap_err().to_string();
        assert!(e.contains("earlier run"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
