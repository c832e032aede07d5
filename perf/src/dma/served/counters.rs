//! The server's `gpu_transfers` counters, read from its stats around each timed request
//! ([`Counters`]), summed over a series ([`Sums`]) and given per request or per job.

use std::time::{Duration, Instant};

use super::result::{GpuTimeline, SubmitParts};

/// The server's `gpu_transfers` counters of one direction (`save` or `load`): seconds its DMA
/// thread was busy, its requests' lead and tail seconds, its requests; each None when the
/// server does not report it.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Counters {
    busy_s: Option<f64>,
    lead_s: Option<f64>,
    tail_s: Option<f64>,
    /// Seconds the idle DMA thread took to take up new jobs.
    pickup_s: Option<f64>,
    requests: Option<f64>,
    /// Completed jobs and their host-side copies.
    jobs: Option<f64>,
    host_runs: Option<f64>,
    /// Seconds handing jobs to the GPU, and (saves) waiting for checksums after the copy.
    submit_s: Option<f64>,
    checksum_wait_s: Option<f64>,
    /// Of `submit_s`, the DMA thread's own CPU time, and the time it waited for the GPU.
    submit_cpu_s: Option<f64>,
    submit_wait_s: Option<f64>,
    /// Of `submit_s`: pieces, staged batches, checksum tables (`submit_parts` in order).
    submit_parts: [Option<f64>; 3],
    /// `--gpu-timeline` sums: bytes, span, copy busy, copy gaps, kernel seconds, busy
    /// periods, lead and tail seconds.
    timeline: [Option<f64>; 8],
}

impl Counters {
    pub(super) fn read(socket: &std::path::Path, direction: &str) -> Self {
        let stats =
            crate::admin::client(socket).request(&orbitkv_proto::admin::AdminRequest::Stats);
        let Ok(stats) = stats else { return Self::default() };
        let g = &stats["gpu_transfers"];
        let f = |name: &str| g[format!("{direction}_{name}")].as_f64();
        let t = |name: &str| g["timeline"][direction][name].as_f64();
        Self {
            busy_s: f("busy_s"),
            lead_s: f("lead_s"),
            tail_s: f("tail_s"),
            pickup_s: f("pickup_s"),
            requests: f("requests"),
            jobs: f("jobs"),
            host_runs: f("host_runs"),
            submit_s: f("submit_s"),
            checksum_wait_s: f("checksum_wait_s"),
            submit_cpu_s: f("submit_cpu_s"),
            submit_wait_s: f("submit_wait_s"),
            // A load has no checksum tables: zero rather than missing.
            submit_parts: [
                f("submit_pieces_s"),
                f("submit_stage_s"),
                f("submit_tables_s").or(f("submit_stage_s").map(|_| 0.0)),
            ],
            timeline: [
                "bytes",
                "span_s",
                "copy_busy_s",
                "copy_gaps_s",
                "kernel_busy_s",
                "periods",
                "lead_s",
                "tail_s",
            ]
            .map(t),
        }
    }

    /// As [`Counters::read`], after a run that `before` was read ahead of: with the server's
    /// `--gpu-timeline`, once the run's busy period is summed too (the DMA thread sums it
    /// after idling a moment; read too soon, it would count towards the next run, or none),
    /// waiting at most 50 ms.
    pub(super) fn read_after(socket: &std::path::Path, direction: &str, before: &Self) -> Self {
        let deadline = Instant::now() + Duration::from_millis(50);
        loop {
            let after = Self::read(socket, direction);
            let summed = match (before.timeline[5], after.timeline[5]) {
                (Some(b), Some(a)) => a > b,
                _ => true,
            };
            if summed || Instant::now() >= deadline {
                return after;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// The timed runs' counters, summed between the readings around each run (NaN once a reading
/// was missing).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Sums {
    pub(super) busy_s: f64,
    pub(super) lead_s: f64,
    pub(super) tail_s: f64,
    pub(super) pickup_s: f64,
    requests: f64,
    jobs: f64,
    host_runs: f64,
    pub(super) submit_s: f64,
    pub(super) checksum_wait_s: f64,
    pub(super) submit_cpu_s: f64,
    pub(super) submit_wait_s: f64,
    submit_parts: [f64; 3],
    timeline: [f64; 8],
}

impl Sums {
    pub(super) fn add(&mut self, before: Counters, after: Counters) {
        self.busy_s += busy_delta(before.busy_s, after.busy_s);
        self.lead_s += busy_delta(before.lead_s, after.lead_s);
        self.tail_s += busy_delta(before.tail_s, after.tail_s);
        self.pickup_s += busy_delta(before.pickup_s, after.pickup_s);
        self.requests += busy_delta(before.requests, after.requests);
        self.jobs += busy_delta(before.jobs, after.jobs);
        self.host_runs += busy_delta(before.host_runs, after.host_runs);
        self.submit_s += busy_delta(before.submit_s, after.submit_s);
        self.checksum_wait_s += busy_delta(before.checksum_wait_s, after.checksum_wait_s);
        self.submit_cpu_s += busy_delta(before.submit_cpu_s, after.submit_cpu_s);
        self.submit_wait_s += busy_delta(before.submit_wait_s, after.submit_wait_s);
        for (sum, (b, a)) in self
            .submit_parts
            .iter_mut()
            .zip(before.submit_parts.into_iter().zip(after.submit_parts))
        {
            *sum += busy_delta(b, a);
        }
        for (sum, (b, a)) in
            self.timeline.iter_mut().zip(before.timeline.into_iter().zip(after.timeline))
        {
            *sum += busy_delta(b, a);
        }
    }

    /// The `--gpu-timeline` sums per request (None when the server did not time its batches,
    /// a reading was missing, or no batch was timed).
    pub(super) fn timeline(&self) -> Option<GpuTimeline> {
        let [bytes, span, busy, gaps, kernel, periods, lead, tail] = self.timeline;
        if !(bytes > 0.0 && busy > 0.0) {
            return None;
        }
        Some(GpuTimeline {
            copy_gbps: bytes / busy / 1e9,
            span_us: self.per_request_us(span)?,
            copy_gaps_us: self.per_request_us(gaps)?,
            kernel_us: self.per_request_us(kernel)?,
            periods_per_request: self.per_request_us(periods).map(|p| p / 1e6),
            lead_us: self.per_request_us(lead),
            tail_us: self.per_request_us(tail),
        })
    }

    /// Host-side copies per completed job (None without jobs or a reading).
    pub(super) fn runs_per_job(&self) -> Option<f64> {
        self.per_job(self.host_runs)
    }

    /// `total` per completed job (None without jobs or a reading).
    pub(super) fn per_job(&self, total: f64) -> Option<f64> {
        (total.is_finite() && self.jobs.is_finite() && self.jobs > 0.0).then(|| total / self.jobs)
    }

    /// The submit time's parts per job (None when a reading was missing or no job ran).
    pub(super) fn submit_parts(&self) -> Option<SubmitParts> {
        let [pieces, stage, tables] = self.submit_parts.map(|s| self.per_job(s * 1e6));
        let rest = self.submit_s - self.submit_wait_s - self.submit_parts.iter().sum::<f64>();
        Some(SubmitParts {
            pieces_us: pieces?,
            stage_us: stage?,
            tables_us: tables?,
            cuda_us: self.per_job(rest * 1e6)?,
        })
    }

    /// Mean microseconds per request of `total_s` (None without requests or a reading).
    pub(super) fn per_request_us(&self, total_s: f64) -> Option<f64> {
        (total_s.is_finite() && self.requests.is_finite() && self.requests > 0.0)
            .then(|| total_s / self.requests * 1e6)
    }
}

/// A counter's increase between two readings (NaN when either is missing).
fn busy_delta(before: Option<f64>, after: Option<f64>) -> f64 {
    match (before, after) {
        (Some(b), Some(a)) => a - b,
        _ => f64::NAN,
    }
}

/// All timed runs' bytes over all their busy seconds, GB/s (None without busy time or with
/// a missing reading).
pub(super) fn busy_gbps(bytes: u64, busy_s: f64) -> Option<f64> {
    (busy_s.is_finite() && busy_s > 0.0).then(|| bytes as f64 / busy_s / 1e9)
}

#[cfg(test)]
mod tests {
    use super::{busy_delta, busy_gbps, Counters, Sums};

    #[test]
    fn busy_rate_needs_both_readings_and_time() {
        let runs = busy_delta(Some(1.0), Some(1.5)) + busy_delta(Some(4.0), Some(4.5));
        assert_eq!(busy_gbps(2_000_000_000, runs), Some(2.0));
        // A missing reading in any run: no rate.
        assert_eq!(busy_gbps(1, runs + busy_delta(None, Some(2.0))), None);
        assert_eq!(busy_gbps(1, busy_delta(Some(1.0), None)), None);
        // No busy time between the readings (the counter did not move): no rate.
        assert_eq!(busy_gbps(1, busy_delta(Some(3.0), Some(3.0))), None);
    }

    #[test]
    fn lead_and_tail_are_means_per_request_over_the_timed_runs() {
        let at = |lead: f64, tail: f64, requests: f64| Counters {
            busy_s: Some(1.0),
            lead_s: Some(lead),
            tail_s: Some(tail),
            // The DMA thread's wake-up: a fifth of the lead here.
            pickup_s: Some(lead / 5.0),
            requests: Some(requests),
            ..Counters::default()
        };
        let mut sums = Sums::default();
        sums.add(at(0.5, 0.1, 10.0), at(0.5003, 0.1001, 11.0));
        sums.add(at(0.5003, 0.1001, 11.0), at(0.5008, 0.1004, 12.0));
        let (lead, tail) = (sums.per_request_us(sums.lead_s), sums.per_request_us(sums.tail_s));
        assert!((lead.unwrap() - 400.0).abs() < 1e-6, "{lead:?}");
        assert!((tail.unwrap() - 200.0).abs() < 1e-6, "{tail:?}");
        let pickup = sums.per_request_us(sums.pickup_s);
        assert!((pickup.unwrap() - 80.0).abs() < 1e-6, "{pickup:?}");
        // A server that does not report them, or no request between the readings: nothing.
        let mut old = Sums::default();
        old.add(Counters::default(), Counters::default());
        assert_eq!(old.per_request_us(old.lead_s), None);
        let mut idle = Sums::default();
        idle.add(at(1.0, 1.0, 3.0), at(1.0, 1.0, 3.0));
        assert_eq!(idle.per_request_us(idle.lead_s), None);
    }

    #[test]
    fn the_server_timeline_is_summed_over_runs_and_given_per_request() {
        // (requests, bytes, span, copy busy, copy gaps, kernel seconds, busy periods, lead,
        // tail) so far.
        let at = |r: f64, t: [f64; 8]| Counters {
            requests: Some(r),
            timeline: t.map(Some),
            ..Counters::default()
        };
        let mut sums = Sums::default();
        sums.add(
            at(4.0, [1e9, 1.0, 1.0, 0.1, 0.2, 7.0, 0.5, 0.25]),
            at(5.0, [3e9, 1.05, 1.04, 0.1001, 0.2002, 8.0, 0.5001, 0.25]),
        );
        sums.add(
            at(5.0, [3e9, 1.05, 1.04, 0.1001, 0.2002, 8.0, 0.5001, 0.25]),
            at(6.0, [5e9, 1.1, 1.08, 0.1003, 0.2004, 11.0, 0.5004, 0.2501]),
        );
        let t = sums.timeline().expect("timed");
        assert!((t.copy_gbps - 4e9 / 0.08 / 1e9).abs() < 1e-6, "{t:?}");
        assert!((t.span_us - 50_000.0).abs() < 1e-3, "{t:?}");
        assert!((t.copy_gaps_us - 150.0).abs() < 1e-3, "{t:?}");
        assert!((t.kernel_us - 200.0).abs() < 1e-3, "{t:?}");
        assert_eq!(t.periods_per_request, Some(2.0), "one, then three busy periods");
        assert!((t.lead_us.unwrap() - 200.0).abs() < 1e-3, "{t:?}");
        assert!((t.tail_us.unwrap() - 50.0).abs() < 1e-3, "{t:?}");
        // A server without --gpu-timeline (no such counters), or nothing timed: none.
        let mut plain = Sums::default();
        plain.add(at(1.0, [0.0; 8]), Counters { requests: Some(2.0), ..Counters::default() });
        assert_eq!(plain.timeline(), None);
        let mut none = Sums::default();
        let idle = [7.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0];
        none.add(at(1.0, idle), at(2.0, idle));
        assert_eq!(none.timeline(), None);
        // A server from before the lead and tail: the rest, without them.
        let old = |r: f64, t: [f64; 6]| {
            let mut c = at(r, [0.0; 8]);
            c.timeline = [t.map(Some).as_slice(), &[None, None]].concat().try_into().unwrap();
            c
        };
        let mut older = Sums::default();
        older.add(
            old(1.0, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
            old(2.0, [1e9, 0.1, 0.1, 0.0, 0.0, 1.0]),
        );
        let t = older.timeline().expect("timed");
        assert_eq!((t.lead_us, t.tail_us), (None, None));
        assert!((t.copy_gbps - 10.0).abs() < 1e-9, "{t:?}");
    }

    #[test]
    fn host_runs_are_given_per_job_over_the_timed_runs() {
        let at = |jobs: f64, runs: f64| Counters {
            jobs: Some(jobs),
            host_runs: Some(runs),
            ..Counters::default()
        };
        let mut sums = Sums::default();
        sums.add(at(10.0, 40.0), at(26.0, 72.0));
        sums.add(at(26.0, 72.0), at(42.0, 104.0));
        assert_eq!(sums.runs_per_job(), Some(2.0));
        let mut old = Sums::default();
        old.add(Counters::default(), Counters::default());
        assert_eq!(old.runs_per_job(), None, "a server without the counters");
        let mut idle = Sums::default();
        idle.add(at(3.0, 9.0), at(3.0, 9.0));
        assert_eq!(idle.runs_per_job(), None, "no job");
    }

    #[test]
    fn submit_and_checksum_wait_are_given_per_job() {
        let at = |jobs: f64, submit: f64, wait: Option<f64>| Counters {
            jobs: Some(jobs),
            submit_s: Some(submit),
            checksum_wait_s: wait,
            ..Counters::default()
        };
        let mut sums = Sums::default();
        sums.add(at(10.0, 1.0, Some(0.5)), at(30.0, 1.002, Some(0.5006)));
        sums.add(at(30.0, 1.002, Some(0.5006)), at(50.0, 1.004, Some(0.5008)));
        assert!((sums.per_job(sums.submit_s * 1e6).unwrap() - 100.0).abs() < 1e-6);
        assert!((sums.per_job(sums.checksum_wait_s * 1e6).unwrap() - 20.0).abs() < 1e-6);
        // The DMA thread's own CPU time, per job, from the same readings; an older server
        // without the counter gives none.
        let cpu = |jobs: f64, cpu: f64| Counters {
            submit_cpu_s: Some(cpu),
            submit_wait_s: Some(cpu / 2.0),
            ..at(jobs, 0.0, None)
        };
        let mut sums = Sums::default();
        sums.add(cpu(10.0, 2.0), cpu(20.0, 2.003));
        assert!((sums.per_job(sums.submit_cpu_s * 1e6).unwrap() - 300.0).abs() < 1e-6);
        assert!((sums.per_job(sums.submit_wait_s * 1e6).unwrap() - 150.0).abs() < 1e-6);
        // The submit time's parts; the rest, past the wait and the planning, is CUDA calls.
        let parts = |jobs: f64, submit: f64| Counters {
            submit_wait_s: Some(submit / 2.0),
            submit_parts: [Some(submit / 8.0), Some(submit / 8.0), Some(submit / 16.0)],
            ..at(jobs, submit, None)
        };
        let mut sums = Sums::default();
        sums.add(parts(10.0, 1.6), parts(20.0, 1.616));
        let p = sums.submit_parts().unwrap();
        let near = |x: f64, y: f64| (x - y).abs() < 1e-6;
        assert!(near(p.pieces_us, 200.0) && near(p.stage_us, 200.0), "{p:?}");
        assert!(near(p.tables_us, 100.0) && near(p.cuda_us, 300.0), "{p:?}");
        assert!(Sums::default().submit_parts().is_none());
        let mut old = Sums::default();
        old.add(at(1.0, 0.0, None), at(2.0, 0.001, None));
        assert_eq!(old.per_job(old.submit_cpu_s * 1e6), None);
        assert_eq!(old.per_job(old.submit_wait_s * 1e6), None);
        assert!(old.submit_parts().is_none());
        // Loads have no checksum wait: the server does not report one.
        let mut loads = Sums::default();
        loads.add(at(1.0, 0.0, None), at(2.0, 0.001, None));
        assert_eq!(loads.per_job(loads.checksum_wait_s), None);
    }
}
