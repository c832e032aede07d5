//! `orbitkv-perf dma --interference`: how much the copies slow down the engine's own GPU work.
//!
//! The engine's work is stood in for by a bf16 matrix multiplication loop in a Python process
//! with PyTorch ([`super::matmul_loop`]), on the same device. The loop's rate alone is compared
//! with its rate while saves, then loads, run back to back in this process (or through the
//! server: [`super::served`]). This module holds the sequence of a run, windows of the loop
//! alone alternated with measurements beside a copy ([`Windows`]), and the rows it gives
//! ([`InterferenceResult`]).

use serde::Serialize;

use super::matmul_loop::MatmulLoop;
use crate::error::Error;
use crate::stats::median;

/// The interference part of the report. The matmul loop's rate drifts by a percent or two
/// over a run (measured on the H200: 602.7 products/s alone at the start of one run, 591.1 at
/// its end), as much as the differences looked for, so every measurement beside a copy is
/// bracketed by windows of the loop alone, and its slowdown is against the mean of the two
/// windows around it; `--interference-rounds` repeats the whole sequence.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct InterferenceResult {
    /// Matrix products per second in the first window alone.
    pub matmul_per_s_alone: f64,
    /// ... and in the last.
    pub matmul_per_s_alone_after: f64,
    /// Every window alone, in order: one before each measurement beside a copy, one after the
    /// last.
    pub solo_per_s: Vec<f64>,
    /// Largest rate alone over the smallest, minus one: how far the loop drifted by itself.
    pub solo_spread: f64,
    /// Times the sequence of measurements ran.
    pub rounds: u32,
    /// One row per strategy and direction, in the order first measured.
    pub rows: Vec<InterferenceRow>,
}

/// The matmul loop beside one way of copying, run back to back for a window, each round.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct InterferenceRow {
    /// `contiguous` (the ceiling copy), `auto`, `staged`, `batched`, `auto+checksums`
    /// (saves with the GPU checksums by row-sum kernels beside them, `--checksum-form gpu`;
    /// `auto+fused-host` and the like for the other forms, the default's as the server runs
    /// them by default),
    /// `server` (saves and loads through orbitkv-server, `--socket`), `server-stream` (the
    /// same, four requests with two in flight), `engine-side` (the matmul's own process
    /// gathers into staging and copies, as an engine with the engine-side gather does), or
    /// `engine-gather` (that process gathers, and the server copies its staging's chunks).
    pub strategy: &'static str,
    /// `save` or `load`.
    pub direction: &'static str,
    /// Matrix products per second meanwhile (median over the rounds).
    pub matmul_per_s: f64,
    /// 1 - matmul_per_s / the mean of the windows alone just before and just after (median
    /// over the rounds).
    pub slowdown: f64,
    /// The smallest and largest of the rounds' slowdowns.
    pub slowdown_min: f64,
    pub slowdown_max: f64,
    /// Each round's slowdown, in order.
    pub slowdowns: Vec<f64>,
    /// Median GB/s of the copies meanwhile (median over the rounds).
    pub copy_gbps: f64,
}

/// One measurement beside a copy: (strategy, direction, products per second, copy GB/s), and
/// the index of the window alone just before it.
struct Beside {
    strategy: &'static str,
    direction: &'static str,
    rate: f64,
    copy_gbps: f64,
    solo_before: usize,
}

/// The sequence of a run: windows alone and measurements beside copies, alternated.
#[derive(Default)]
pub(crate) struct Windows {
    solos: Vec<f64>,
    beside: Vec<Beside>,
    rounds: u32,
}

impl Windows {
    /// A window alone, then `f` (returning the loop's products per second while it ran and
    /// the copies' GB/s) recorded as `strategy`, `direction`.
    pub(crate) fn measure(
        &mut self,
        matmul: &mut MatmulLoop,
        strategy: &'static str,
        direction: &'static str,
        f: impl FnOnce(&mut MatmulLoop) -> Result<(f64, f64), Error>,
    ) -> Result<(), Error> {
        self.solos.push(matmul.alone());
        let (rate, copy_gbps) = f(matmul)?;
        let solo_before = self.solos.len() - 1;
        self.beside.push(Beside { strategy, direction, rate, copy_gbps, solo_before });
        Ok(())
    }

    /// Marks the end of one round of measurements.
    pub(crate) fn end_round(&mut self) {
        self.rounds += 1;
    }

    /// The last window alone, then the result.
    pub(crate) fn finish(mut self, matmul: &MatmulLoop) -> InterferenceResult {
        self.solos.push(matmul.alone());
        summarize(self.solos, self.beside, self.rounds)
    }
}

/// The rows of a run: each measurement's slowdown against the mean of the windows alone around
/// it, grouped by (strategy, direction) in the order first measured.
fn summarize(solos: Vec<f64>, beside: Vec<Beside>, rounds: u32) -> InterferenceResult {
    let mut groups: Vec<((&'static str, &'static str), Vec<&Beside>)> = Vec::new();
    for b in &beside {
        let key = (b.strategy, b.direction);
        match groups.iter_mut().find(|g| g.0 == key) {
            Some(g) => g.1.push(b),
            None => groups.push((key, vec![b])),
        }
    }
    let slowdown = |b: &Beside| {
        let around = [solos.get(b.solo_before), solos.get(b.solo_before + 1)];
        let known: Vec<f64> = around.into_iter().flatten().copied().filter(|r| *r > 0.0).collect();
        if known.is_empty() || b.rate <= 0.0 {
            return 0.0;
        }
        1.0 - b.rate / (known.iter().sum::<f64>() / known.len() as f64)
    };
    let rows = groups
        .into_iter()
        .map(|((strategy, direction), bs)| {
            let slowdowns: Vec<f64> = bs.iter().map(|b| slowdown(b)).collect();
            InterferenceRow {
                strategy,
                direction,
                matmul_per_s: median(&bs.iter().map(|b| b.rate).collect::<Vec<_>>()).unwrap_or(0.0),
                slowdown: median(&slowdowns).unwrap_or(0.0),
                slowdown_min: slowdowns.iter().copied().fold(f64::INFINITY, f64::min),
                slowdown_max: slowdowns.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                slowdowns,
                copy_gbps: median(&bs.iter().map(|b| b.copy_gbps).collect::<Vec<_>>())
                    .unwrap_or(0.0),
            }
        })
        .collect();
    let positive: Vec<f64> = solos.iter().copied().filter(|r| *r > 0.0).collect();
    let lo = positive.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = positive.iter().copied().fold(0.0, f64::max);
    InterferenceResult {
        matmul_per_s_alone: solos.first().copied().unwrap_or(0.0),
        matmul_per_s_alone_after: solos.last().copied().unwrap_or(0.0),
        solo_spread: if positive.is_empty() { 0.0 } else { hi / lo - 1.0 },
        solo_per_s: solos,
        rounds,
        rows,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beside(strategy: &'static str, direction: &'static str, rate: f64, at: usize) -> Beside {
        Beside { strategy, direction, rate, copy_gbps: rate / 10.0, solo_before: at }
    }

    #[test]
    fn each_measurement_is_against_the_windows_alone_around_it() {
        // The loop alone drifts from 600 to 580 products/s; each copy slows it 2% of its rate
        // at that moment. Against the windows around each measurement that is what is found;
        // against the best window alone it would read 2.8-4.5%.
        let solos = vec![600.0, 590.0, 580.0, 600.0, 590.0, 580.0];
        let at = |i: usize| 0.98 * (solos[i] + solos[i + 1]) / 2.0;
        let rows = vec![
            beside("auto", "save", at(0), 0),
            beside("auto", "load", at(1), 1),
            beside("engine-side", "save", at(2), 2),
            beside("auto", "save", at(3), 3),
            beside("auto", "load", at(4), 4),
        ];
        let r = summarize(solos, rows, 2);
        assert_eq!(r.rounds, 2);
        assert_eq!((r.matmul_per_s_alone, r.matmul_per_s_alone_after), (600.0, 580.0));
        assert!((r.solo_spread - (600.0 / 580.0 - 1.0)).abs() < 1e-12, "{}", r.solo_spread);
        let names: Vec<_> = r.rows.iter().map(|x| (x.strategy, x.direction)).collect();
        assert_eq!(names, [("auto", "save"), ("auto", "load"), ("engine-side", "save")]);
        for row in &r.rows {
            assert!((row.slowdown - 0.02).abs() < 1e-12, "{row:?}");
            assert!(row.slowdown_min <= row.slowdown && row.slowdown <= row.slowdown_max);
        }
        assert_eq!(r.rows[0].slowdowns.len(), 2);
        assert_eq!(r.rows[2].slowdowns.len(), 1);
        // The median over rounds, and the range.
        let rows = vec![
            beside("auto", "save", 588.0, 0),
            beside("auto", "save", 570.0, 1),
            beside("auto", "save", 594.0, 2),
        ];
        let r = summarize(vec![600.0; 4], rows, 3);
        let row = &r.rows[0];
        assert!((row.slowdown - 0.02).abs() < 1e-12, "{row:?}");
        assert!((row.slowdown_min - 0.01).abs() < 1e-12, "{row:?}");
        assert!((row.slowdown_max - 0.05).abs() < 1e-12, "{row:?}");
        assert_eq!(row.matmul_per_s, 588.0);
        assert!((row.copy_gbps - 58.8).abs() < 1e-9, "{row:?}");
    }

    #[test]
    fn windows_without_lines_count_as_unknown_not_as_zero() {
        // A window alone that saw no line (rate 0) is left out of the reference; a measurement
        // with no rate has no slowdown rather than 100%.
        let r = summarize(
            vec![0.0, 600.0, 0.0],
            vec![beside("x", "save", 594.0, 0), beside("y", "load", 0.0, 1)],
            1,
        );
        assert!((r.rows[0].slowdown - 0.01).abs() < 1e-12, "{:?}", r.rows[0]);
        assert_eq!(r.rows[1].slowdown, 0.0);
        assert_eq!(r.solo_spread, 0.0);
        let r = summarize(vec![0.0, 0.0], vec![beside("x", "save", 594.0, 0)], 1);
        assert_eq!(r.rows[0].slowdown, 0.0);
        let empty = summarize(Vec::new(), Vec::new(), 0);
        assert!(empty.rows.is_empty() && empty.solo_spread == 0.0);
    }
}
