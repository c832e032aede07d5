//! `--interference` through the server: the matmul loop beside the server's saves and loads
//! of every chunk (`server` rows), the same streamed (`server-stream`), the engine-side copies
//! in the loop's own process (`engine-side`), and that process's gathers copied by the server
//! (`engine-gather`: [`super::gathered`]).

use std::time::Instant;

use orbitkv_client::{ChunkKey, Client};

use super::counters::{busy_gbps, Counters, Sums};
use super::engine::{client_err, not_done, Engine};
use super::gathered::{engine_gather, Gathered};
use super::result::BesideMatmul;
use super::Requests;
use crate::args::DmaArgs;
use crate::dma::interference::{InterferenceResult, Windows};
use crate::dma::matmul_loop::{EngineSide, MatmulLoop};
use crate::dma::median;
use crate::error::Error;

/// `--interference` through the server: the matmul loop beside back-to-back saves and then
/// loads of every chunk through the server (its copies, its checksums), then beside the same
/// streamed (`server-stream`: see [`streamed`]), then beside the engine-side copies in the
/// loop's own process, then beside that process's gathers copied by the server
/// (`engine-gather`: see [`Gathered`]), each after a window of the loop alone (one more at the end),
/// `--interference-rounds` times. Each save follows an evict, and each save and load is framed
/// by two readings of the server's stats, inside the loop's window: a few milliseconds without
/// copies per save, so the `server` rows understate the slowdown slightly. Also returns the
/// chunks not done (saves, loads) and the server's counters over the saves and loads beside
/// the loop.
pub(super) fn served_interference(
    a: &DmaArgs,
    e: &Engine<'_>,
    client: &mut Client,
    reg: &orbitkv_client::GpuRegistration,
    (keys, blocks): (&[ChunkKey], &[u64]),
    shape: EngineSide,
) -> Result<(InterferenceResult, (u64, u64), BesideMatmul), Error> {
    let socket = a.socket.as_ref().expect("server mode has a socket");
    let bytes = e.chunk_len * keys.len() as u64;
    let mut matmul = MatmulLoop::start(a.device, Some(shape))?;
    let mut gathered = Gathered::register(client, &matmul, shape, (e, keys), a.seed)
        .unwrap_or_else(|err| {
            eprintln!("--interference: no engine-gather rows: {err}");
            None
        });
    let mut windows = Windows::default();
    let mut beside = ServedBeside {
        requests: Requests { client, reg, keys, blocks },
        socket,
        chunk_len: e.chunk_len,
        bytes,
        failed: (0, 0),
        sums: [Sums::default(), Sums::default()],
        copied: [0u64, 0],
        stream_sums: [Sums::default(), Sums::default()],
        stream_copied: [0u64, 0],
    };
    for _ in 0..a.interference_rounds {
        beside.server_rows(&mut windows, &mut matmul)?;
        beside.streamed_rows(&mut windows, &mut matmul)?;
        matmul.engine_side_rows(&mut windows)?;
        beside.engine_gather_rows(&mut windows, &mut matmul, &mut gathered);
        windows.end_round();
    }
    if let Some(g) = gathered {
        let client = &mut *beside.requests.client;
        client.unregister_gpu(&g.reg).map_err(client_err("unregister_gpu (engine staging)"))?;
    }
    let result = windows.finish(&matmul);
    Ok((result, beside.failed, beside.counters()))
}

/// The server's rows beside the matmul loop ([`served_interference`]) and what they add up
/// over the rounds: the chunks not done (saves, loads), and per way (save, load) the server's
/// counters with the bytes they cover, for the requests of every chunk and for the streamed
/// runs.
struct ServedBeside<'a> {
    requests: Requests<'a>,
    socket: &'a std::path::Path,
    chunk_len: u64,
    /// Bytes of a request of every chunk.
    bytes: u64,
    failed: (u64, u64),
    sums: [Sums; 2],
    copied: [u64; 2],
    stream_sums: [Sums; 2],
    stream_copied: [u64; 2],
}

impl ServedBeside<'_> {
    /// The `server` rows: back-to-back saves (each after an evict), then loads, of every chunk.
    fn server_rows(&mut self, windows: &mut Windows, matmul: &mut MatmulLoop) -> Result<(), Error> {
        let (socket, bytes) = (self.socket, self.bytes);
        for (w, way) in ["save", "load"].into_iter().enumerate() {
            let r = &mut self.requests;
            let (client, reg, keys, blocks) = (&mut *r.client, r.reg, r.keys, r.blocks);
            let (sums, copied, failed) = (&mut self.sums, &mut self.copied, &mut self.failed);
            windows.measure(matmul, "server", way, |m| {
                let (rate, runs) = m.during(|| {
                    if way == "save" {
                        client.evict(keys).map_err(client_err("evict"))?;
                    }
                    let before = Counters::read(socket, way);
                    let t = Instant::now();
                    let outcomes = if way == "save" {
                        client.save(reg, keys, blocks)
                    } else {
                        client.load(reg, keys, blocks)
                    }
                    .map_err(client_err(way))?;
                    let gbps = bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
                    sums[w].add(before, Counters::read_after(socket, way, &before));
                    copied[w] += bytes;
                    Ok((gbps, not_done(&outcomes)))
                })?;
                let not_done: u64 = runs.iter().map(|r| r.1).sum();
                if way == "save" {
                    failed.0 += not_done;
                } else {
                    failed.1 += not_done;
                }
                Ok((rate, median(runs.into_iter().map(|r| r.0).collect())))
            })?;
        }
        Ok(())
    }

    /// The `server-stream` rows: saves, then loads, streamed (see [`streamed`]).
    fn streamed_rows(
        &mut self,
        windows: &mut Windows,
        matmul: &mut MatmulLoop,
    ) -> Result<(), Error> {
        let (socket, chunk_len) = (self.socket, self.chunk_len);
        for (w, way) in ["save", "load"].into_iter().enumerate() {
            let r = &mut self.requests;
            let (client, reg, keys, blocks) = (&mut *r.client, r.reg, r.keys, r.blocks);
            let (stream_sums, stream_copied) = (&mut self.stream_sums, &mut self.stream_copied);
            let failed = &mut self.failed;
            windows.measure(matmul, "server-stream", way, |m| {
                let before = Counters::read(socket, way);
                let (rate, runs) =
                    m.during(|| streamed(client, reg, (keys, blocks, chunk_len), way))?;
                stream_sums[w].add(before, Counters::read_after(socket, way, &before));
                let (moved, not_done, took) =
                    runs.iter().fold((0, 0, 0.0), |t, r| (t.0 + r.0, t.1 + r.1, t.2 + r.2));
                stream_copied[w] += moved;
                if way == "save" {
                    failed.0 += not_done;
                } else {
                    failed.1 += not_done;
                }
                Ok((rate, moved as f64 / took / 1e9))
            })?;
        }
        Ok(())
    }

    /// The `engine-gather` rows, when `gathered` is registered: saves, then loads. A failure
    /// loses these rows only (the staging's registration is dropped, said on stderr), not the
    /// run's others.
    fn engine_gather_rows(
        &mut self,
        windows: &mut Windows,
        matmul: &mut MatmulLoop,
        gathered: &mut Option<Gathered>,
    ) {
        let mut gather_failed = false;
        if let Some(g) = gathered.as_mut() {
            for way in ["save", "load"] {
                let (client, failed) = (&mut *self.requests.client, &mut self.failed);
                let measured = windows.measure(matmul, "engine-gather", way, |m| {
                    let (rate, gbps, not_done) = engine_gather(m, client, g, way)?;
                    if way == "save" {
                        failed.0 += not_done;
                    } else {
                        failed.1 += not_done;
                    }
                    Ok((rate, gbps))
                });
                // A failure here loses these rows only, not the run's others.
                if let Err(e) = measured {
                    let _ = matmul.command("idle");
                    eprintln!("--interference: engine-gather {way}s: {e}; no more of them");
                    gather_failed = true;
                    break;
                }
            }
        }
        if gather_failed {
            if let Some(g) = gathered.take() {
                let _ = self.requests.client.unregister_gpu(&g.reg);
            }
        }
    }

    /// The server's counters over the saves and loads of every chunk, and over the streamed
    /// ones.
    fn counters(&self) -> BesideMatmul {
        let [save, load] = &self.sums;
        let (copied, stream_sums, stream_copied) =
            (&self.copied, &self.stream_sums, &self.stream_copied);
        BesideMatmul {
            save_busy_gbps: busy_gbps(copied[0], save.busy_s),
            save_submit_us_per_job: save.per_job(save.submit_s * 1e6),
            save_checksum_wait_us_per_job: save.per_job(save.checksum_wait_s * 1e6),
            load_busy_gbps: busy_gbps(copied[1], load.busy_s),
            load_submit_us_per_job: load.per_job(load.submit_s * 1e6),
            save_timeline: save.timeline(),
            load_timeline: load.timeline(),
            stream_save_busy_gbps: busy_gbps(stream_copied[0], stream_sums[0].busy_s),
            stream_load_busy_gbps: busy_gbps(stream_copied[1], stream_sums[1].busy_s),
        }
    }
}

/// Groups a streamed run splits the chunks into: two in flight, and a group saved again only
/// after its previous save has answered (and been evicted).
const STREAM_GROUPS: usize = 4;

/// Saves (`way` "save", each group evicted just before) or loads of `keys` for a matmul
/// window, in [`STREAM_GROUPS`] requests of a quarter of the chunks each, started back to back
/// with two in flight: the next request is queued before the one running ends, so the DMA
/// thread never runs dry between them, as for an engine saving (or loading) as it computes.
/// Returns the bytes moved (of `chunk_len` each), the chunks not done and the seconds taken.
fn streamed(
    client: &mut Client,
    reg: &orbitkv_client::GpuRegistration,
    (keys, blocks, chunk_len): (&[ChunkKey], &[u64], u64),
    way: &'static str,
) -> Result<(u64, u64, f64), Error> {
    let per_chunk = blocks.len() / keys.len().max(1);
    let size = keys.len().div_ceil(STREAM_GROUPS).max(1);
    let groups: Vec<(&[ChunkKey], &[u64])> =
        keys.chunks(size).zip(blocks.chunks(size * per_chunk)).collect();
    let start = Instant::now();
    let (mut moved, mut not_done_) = (0, 0);
    round_robin(
        client,
        groups.len(),
        || start.elapsed() < crate::dma::matmul_loop::WINDOW,
        |client, g| {
            let (k, b) = groups[g];
            if way == "save" {
                client.evict(k).map_err(client_err("evict"))?;
                client.start_save(reg, k, b)
            } else {
                client.start_load(reg, k, b)
            }
            .map_err(client_err(way))
        },
        |client, g, t| {
            let outcomes = client.wait_transfer(&t).map_err(client_err(way))?;
            moved += groups[g].0.len() as u64 * chunk_len;
            not_done_ += not_done(&outcomes);
            Ok(())
        },
    )?;
    Ok((moved, not_done_, start.elapsed().as_secs_f64()))
}

/// Starts group 0, 1, ... of `groups` (round robin) while `more()` says so, two in flight at
/// most (one with fewer than three groups), and waits for each in the order started (also
/// those in flight once `more()` stops): a group is started again only after its previous
/// start was waited for.
fn round_robin<C, T>(
    ctx: &mut C,
    groups: usize,
    mut more: impl FnMut() -> bool,
    mut start: impl FnMut(&mut C, usize) -> Result<T, Error>,
    mut wait: impl FnMut(&mut C, usize, T) -> Result<(), Error>,
) -> Result<(), Error> {
    let most = if groups >= 3 { 2 } else { 1 };
    let mut inflight = std::collections::VecDeque::new();
    let mut next = 0;
    loop {
        while inflight.len() < most && more() {
            let g = next % groups;
            next += 1;
            inflight.push_back((g, start(ctx, g)?));
        }
        let Some((g, t)) = inflight.pop_front() else { return Ok(()) };
        wait(ctx, g, t)?;
    }
}

#[cfg(test)]
mod tests {
    use super::{round_robin, Error};

    #[test]
    fn streamed_groups_go_round_robin_two_in_flight_never_one_twice() {
        // The events as (started?, group), and what is in flight, checked at every start.
        let mut log: (Vec<(bool, usize)>, Vec<usize>) = (Vec::new(), Vec::new());
        let mut starts = 0;
        round_robin(
            &mut log,
            4,
            || {
                starts += 1;
                starts <= 10
            },
            |(events, inflight), g| {
                assert!(!inflight.contains(&g), "group {g} started while in flight");
                assert!(inflight.len() < 2, "three in flight: {inflight:?}");
                inflight.push(g);
                events.push((true, g));
                Ok(g * 10)
            },
            |(events, inflight), g, t| {
                assert_eq!(t, g * 10, "each wait gets its own start's transfer");
                assert_eq!(inflight.remove(0), g, "waited in the order started");
                events.push((false, g));
                Ok(())
            },
        )
        .unwrap();
        let started: Vec<usize> = log.0.iter().filter(|e| e.0).map(|e| e.1).collect();
        assert_eq!(started, [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]);
        assert!(log.1.is_empty(), "every start waited for");
        assert_eq!(log.0.len(), 20);
        // The second start comes before the first wait: the next request is queued early.
        assert_eq!(&log.0[..3], &[(true, 0), (true, 1), (false, 0)]);
        // A failed start ends it, after nothing else is started.
        let mut n = 0;
        let e = round_robin(
            &mut n,
            3,
            || true,
            |n, g| {
                *n += 1;
                if g == 2 {
                    Err(Error::InvalidArgument { flag: "--test", reason: "start failed".into() })
                } else {
                    Ok(())
                }
            },
            |_, _, ()| Ok(()),
        );
        assert!(e.is_err());
        assert_eq!(n, 3);
        // Two groups (a run of fewer than four chunks): one at a time.
        let mut log: (Vec<usize>, Option<usize>) = (Vec::new(), None);
        let mut left = 5;
        round_robin(
            &mut log,
            2,
            || {
                left -= 1;
                left >= 0
            },
            |(started, inflight), g| {
                assert_eq!(*inflight, None, "one at a time");
                *inflight = Some(g);
                started.push(g);
                Ok(())
            },
            |(_, inflight), g, ()| {
                assert_eq!(inflight.take(), Some(g));
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(log.0, [0, 1, 0, 1, 0]);
    }
}
