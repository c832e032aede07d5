//! The DMA thread's loop against a fake device: scheduling, order of answers, failures,
//! panics, full completion rings and shutdown, with no GPU.

use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use orbitkv_gpu::dma::DmaError;
use orbitkv_shards::Arena;

use super::*;

/// How a fake job goes.
#[derive(Clone, Debug)]
struct Plan {
    /// `start` refuses it with this message.
    refuse: Option<&'static str>,
    /// `start` panics.
    panic: bool,
    /// Polls answered `Copying`, then `Summing`.
    copying: u32,
    summing: u32,
    /// What it ends with (an error from `progress`).
    outcome: Result<Option<Vec<u64>>, &'static str>,
}

impl Default for Plan {
    fn default() -> Self {
        Self { refuse: None, panic: false, copying: 2, summing: 0, outcome: Ok(None) }
    }
}

fn copy_failed(why: &str) -> JobError {
    JobError::Copy(DmaError::Cuda { op: "cuEventQuery", detail: why.to_string() })
}

/// What the fake device saw, shared with the test.
#[derive(Default)]
struct Seen {
    started: Mutex<Vec<(usize, u64)>>,
    idles: AtomicUsize,
    advances: AtomicUsize,
    dropped: AtomicBool,
}

struct Fake {
    plans: HashMap<u64, Plan>,
    polls: HashMap<u64, u32>,
    seen: Arc<Seen>,
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.seen.dropped.store(true, Ordering::SeqCst);
    }
}

impl Device for Fake {
    type Memory = ();
    type Job = u64;

    fn start(&mut self, job: &GpuJob<()>, _: &mut VecDeque<Running<u64>>) -> Result<u64, JobError> {
        let plan = self.plans.get(&job.id).cloned().unwrap_or_default();
        assert!(!plan.panic, "the fake device panics on job {}", job.id);
        if let Some(why) = plan.refuse {
            return Err(JobError::Start(DmaError::Invalid(why.to_string())));
        }
        self.seen.started.lock().unwrap().push((job.shard, job.id));
        Ok(job.id)
    }

    fn progress(&mut self, id: &u64) -> Result<Progress, JobError> {
        let plan = self.plans.get(id).cloned().unwrap_or_default();
        let n = self.polls.entry(*id).or_default();
        *n += 1;
        Ok(if *n <= plan.copying {
            Progress::Copying
        } else if *n <= plan.copying + plan.summing {
            Progress::Summing
        } else {
            match plan.outcome {
                Err(e) => return Err(copy_failed(e)),
                Ok(_) => Progress::Done,
            }
        })
    }

    fn finish(&mut self, id: u64) -> GpuResult {
        let plan = self.plans.get(&id).cloned().unwrap_or_default();
        plan.outcome.map_err(copy_failed)
    }

    fn host_runs(&self, _: &u64) -> u64 {
        3
    }

    fn advance(&mut self, _: &mut VecDeque<Running<u64>>) -> bool {
        self.seen.advances.fetch_add(1, Ordering::Relaxed);
        false
    }

    fn take_times(&mut self) -> StartTimes {
        StartTimes { waited: Duration::from_micros(5), ..Default::default() }
    }

    fn idle(&mut self) {
        self.seen.idles.fetch_add(1, Ordering::Relaxed);
    }
}

/// The shards' side of one DMA thread: queues, rings, flags, counters.
struct Shards {
    queues: Vec<ArrayQueue<GpuJob<()>>>,
    done: Vec<ArrayQueue<GpuDone>>,
    expected: AtomicBool,
    stop: AtomicBool,
    doorbells: Doorbells,
    counters: GpuCounters,
}

impl Shards {
    fn new(shards: usize, ring: usize) -> Self {
        let arena = Arc::new(Arena::create(64 << 10, false).unwrap());
        Self {
            queues: (0..shards).map(|_| ArrayQueue::new(64)).collect(),
            done: (0..shards).map(|_| ArrayQueue::new(ring)).collect(),
            expected: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            doorbells: Doorbells::new(arena, shards).unwrap(),
            counters: GpuCounters::default(),
        }
    }

    fn lanes(&self, direction: Direction) -> Lanes<'_, ()> {
        Lanes {
            queues: &self.queues,
            done: &self.done,
            expected: &self.expected,
            stop: &self.stop,
            doorbells: &self.doorbells,
            counters: &self.counters,
            direction,
        }
    }

    fn queue(&self, shard: usize, id: u64) {
        let job = GpuJob {
            shard,
            id,
            device: 0,
            memory: (),
            chunks: vec![(0, vec![0, 1]), (4096, vec![2, 3])],
            chunk_len: 4096,
            queued_at: Instant::now(),
        };
        assert!(self.queues[shard].push(job).is_ok(), "room in the queue");
    }

    /// The answers to `n` jobs, per shard in the order they arrived (a hang guard of 30 s,
    /// never expected to be reached).
    fn answers(&self, n: usize, take_every: Duration) -> Vec<Vec<GpuDone>> {
        let mut got: Vec<Vec<GpuDone>> = self.done.iter().map(|_| Vec::new()).collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        while got.iter().map(Vec::len).sum::<usize>() < n {
            assert!(Instant::now() < deadline, "answers missing: {got:?}");
            for (ring, out) in self.done.iter().zip(&mut got) {
                if let Some(d) = ring.pop() {
                    out.push(d);
                }
            }
            std::thread::sleep(take_every);
        }
        got
    }
}

fn ids(answers: &[GpuDone]) -> Vec<u64> {
    answers.iter().map(|d| d.id).collect()
}

fn fake(plans: &[(u64, Plan)], seen: &Arc<Seen>) -> impl FnOnce() -> Fake {
    let (plans, seen) = (plans.iter().cloned().collect(), Arc::clone(seen));
    move || Fake { plans, polls: HashMap::new(), seen }
}

/// Runs a DMA thread over `shards` with a fake device while `test` runs, then stops it;
/// returns once the thread has ended.
fn with_thread(
    shards: &Shards,
    direction: Direction,
    device: impl FnOnce() -> Fake + Send,
    test: impl FnOnce(),
) {
    std::thread::scope(|s| {
        let lanes = shards.lanes(direction);
        let t = s.spawn(move || run(&lanes, device));
        // Stopped also when the test fails: the scope waits for the thread before it passes
        // the failure on, and a thread never stopped would hang the test instead.
        let tested = std::panic::catch_unwind(std::panic::AssertUnwindSafe(test));
        shards.stop.store(true, Ordering::SeqCst);
        t.thread().unpark();
        t.join().expect("the DMA thread ends without a panic escaping");
        if let Err(failure) = tested {
            std::panic::resume_unwind(failure);
        }
    });
}

#[test]
fn jobs_are_taken_from_the_shards_in_turn_and_answered_in_the_order_they_started() {
    let shards = Shards::new(2, 16);
    for id in 1..=3 {
        shards.queue(0, id);
        shards.queue(1, 10 + id);
    }
    // Later jobs would finish first: answers still follow the starts.
    let slow = |copying| Plan { copying, outcome: Ok(Some(vec![7, 8])), ..Plan::default() };
    let plans = [(1, slow(30)), (11, slow(20)), (2, slow(10))];
    let seen = Arc::new(Seen::default());
    with_thread(&shards, Direction::Save, fake(&plans, &seen), || {
        let got = shards.answers(6, Duration::from_micros(50));
        assert_eq!(ids(&got[0]), [1, 2, 3]);
        assert_eq!(ids(&got[1]), [11, 12, 13]);
        assert!(matches!(&got[0][0].result, Ok(Some(s)) if *s == [7, 8]), "{:?}", got[0][0]);
        assert!(matches!(&got[0][2].result, Ok(None)));
    });
    let started = seen.started.lock().unwrap().clone();
    assert_eq!(started, [(0, 1), (1, 11), (0, 2), (1, 12), (0, 3), (1, 13)]);
    let c = &shards.counters;
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
    assert_eq!((n(&c.saves), n(&c.saved_bytes), n(&c.save_host_runs)), (6, 6 * 8192, 18));
    assert_eq!((n(&c.loads), n(&c.failed_jobs)), (0, 0));
    assert_eq!(n(&c.save_submit.wait_ns), 6 * 5_000, "each start's times are added");
    assert!(n(&c.save_pickups) >= 1, "a job taken with nothing in flight is a pick-up");
    assert!(seen.advances.load(Ordering::Relaxed) > 0, "fused folds get their turn");
    assert!(seen.dropped.load(Ordering::SeqCst), "the device goes with the thread");
}

#[test]
fn refused_starts_and_failed_copies_are_answered_with_their_errors() {
    let shards = Shards::new(1, 16);
    for id in 1..=4 {
        shards.queue(0, id);
    }
    let plans = [
        (2, Plan { refuse: Some("chunk of 3 bytes where 4096 were reserved"), ..Plan::default() }),
        (3, Plan { outcome: Err("an illegal address"), ..Plan::default() }),
    ];
    let seen = Arc::new(Seen::default());
    with_thread(&shards, Direction::Load, fake(&plans, &seen), || {
        let got = &shards.answers(4, Duration::from_micros(50))[0];
        // A refused start is answered at once, before the jobs in flight ahead of it.
        assert_eq!(ids(got), [2, 1, 3, 4]);
        assert!(
            matches!(&got[0].result, Err(JobError::Start(e)) if e.to_string().contains("3 bytes")),
            "{got:?}"
        );
        assert!(matches!(&got[1].result, Ok(None)));
        let copy = |e: &JobError| e.to_string().starts_with("CUDA copy failed");
        assert!(
            matches!(&got[2].result, Err(e) if copy(e) && e.to_string().contains("illegal address")),
            "{got:?}"
        );
        assert!(matches!(&got[3].result, Ok(None)));
    });
    let c = &shards.counters;
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
    assert_eq!((n(&c.loads), n(&c.failed_jobs), n(&c.saves)), (2, 2, 0));
    assert!(seen.idles.load(Ordering::Relaxed) >= 1, "a busy period ends when idle");
}

#[test]
fn a_panic_fails_the_jobs_held_and_every_job_after_it() {
    let shards = Shards::new(2, 16);
    shards.queue(0, 1);
    shards.queue(1, 2);
    let plans = [
        (1, Plan { copying: u32::MAX, ..Plan::default() }),
        (2, Plan { panic: true, ..Plan::default() }),
    ];
    let seen = Arc::new(Seen::default());
    with_thread(&shards, Direction::Save, fake(&plans, &seen), || {
        let got = shards.answers(2, Duration::from_micros(50));
        let failed = |d: &GpuDone| matches!(&d.result, Err(JobError::ThreadFailed));
        // The job in flight and the one being started.
        assert!(failed(&got[0][0]) && failed(&got[1][0]), "{got:?}");
        assert!(seen.dropped.load(Ordering::SeqCst), "the device went before the jobs failed");
        // Queued afterwards: failed too, not left waiting.
        shards.queue(1, 3);
        let got = shards.answers(1, Duration::from_micros(50));
        assert!(failed(&got[1][0]) && got[1][0].id == 3, "{got:?}");
    });
    assert_eq!(shards.counters.failed_jobs.load(Ordering::Relaxed), 3);
}

#[test]
fn answers_wait_for_room_in_a_full_ring_and_none_is_lost() {
    let shards = Shards::new(1, 1);
    for id in 1..=5 {
        shards.queue(0, id);
    }
    let seen = Arc::new(Seen::default());
    with_thread(&shards, Direction::Load, fake(&[], &seen), || {
        // Taken slowly: the ring of one holds the thread's answers back, in order.
        let got = &shards.answers(5, Duration::from_millis(2))[0];
        assert_eq!(ids(got), [1, 2, 3, 4, 5]);
    });
    assert_eq!(shards.counters.loads.load(Ordering::Relaxed), 5);
}

#[test]
fn stopping_waits_for_the_jobs_in_flight_and_their_checksums() {
    let shards = Shards::new(1, 16);
    shards.queue(0, 1);
    let plans =
        [(1, Plan { copying: 200, summing: 50, outcome: Ok(Some(vec![9])), ..Plan::default() })];
    let seen = Arc::new(Seen::default());
    // Stop is asked at once: the thread still answers the job before it ends.
    with_thread(&shards, Direction::Save, fake(&plans, &seen), || {
        let deadline = Instant::now() + Duration::from_secs(30);
        while seen.started.lock().unwrap().is_empty() {
            assert!(Instant::now() < deadline, "the job was never started");
            std::thread::yield_now();
        }
    });
    let d = shards.done[0].pop().expect("answered before the thread ended");
    assert!(matches!(&d.result, Ok(Some(s)) if *s == [9]), "{d:?}");
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
    assert_eq!(n(&shards.counters.saves), 1);
}

#[test]
fn the_thread_cpu_clock_advances_with_work_on_this_thread() {
    let start = thread_cpu_ns();
    assert!(start > 0, "the thread CPU clock is readable here");
    // Busy until it has advanced a millisecond (bounded by wall time, never expected).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut x = 0u64;
    while thread_cpu_ns() < start + 1_000_000 {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        assert!(Instant::now() < deadline, "no CPU time counted in 30 s of spinning");
    }
    // It is this thread's clock, not the process's: a new thread starts below it.
    let before = thread_cpu_ns();
    let other = std::thread::spawn(thread_cpu_ns).join().unwrap();
    assert!(other < before, "a new thread's {other} ns against this one's {before}");
}

#[test]
fn an_announced_job_keeps_the_idle_thread_spinning_longer() {
    let t0 = Instant::now();
    let at = |us: u64| t0 + Duration::from_micros(us);
    let mut s = SpinUntil::new(t0);
    assert!(s.spinning(at(IDLE_SPIN_US - 1)));
    assert!(!s.spinning(at(IDLE_SPIN_US)), "parks after the idle spin");
    // Announced later: spins for the announcement's window from then on.
    s.expected(at(1_000));
    let window = EXPECT_SPIN.as_micros() as u64;
    assert!(s.spinning(at(1_000 + window - 1)));
    assert!(!s.spinning(at(1_000 + window)));
    // Work within the window never shortens it; work after it opens the idle spin.
    s.worked(at(1_100));
    assert!(s.spinning(at(1_000 + window - 1)), "work does not cut the wait short");
    s.worked(at(5_000));
    assert!(s.spinning(at(5_000 + IDLE_SPIN_US - 1)));
    assert!(!s.spinning(at(5_000 + IDLE_SPIN_US)));
}

#[test]
fn the_timer_slack_can_be_set() {
    set_timer_slack_ns(1_000);
    assert_eq!(nix::sys::prctl::get_timerslack().unwrap(), 1_000);
}
