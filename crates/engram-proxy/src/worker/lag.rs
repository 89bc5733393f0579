//! Bounding the update path's lag (`worker.max_lag_ms`).
//!
//! The worker's `SCHED_IDLE` threads get no CPU while other processes keep every core busy (a
//! pod sharing a node with its app), and an unprivileged thread cannot leave `SCHED_IDLE` again
//! (that needs `CAP_SYS_NICE` or an `RLIMIT_NICE` above 0). So the priority is raised by moving
//! the work instead: a second claim loop, the catch-up, runs on a normal-priority thread of its
//! own and claims only while this module says so. A monitor on that thread looks every [`TICK`]:
//!
//! - the lag: how long the queue has held work without progress (a job applied, the queue seen
//!   empty or shrinking), or the lag of the last applied job, whichever is more ([`Progress`]);
//! - whether the idle threads get the CPU at all: a probe task sent to their runtime must run
//!   within [`PROMPT`], and a run they are computing must have run (see `super::stall`).
//!
//! [`LagGate`] turns those into who may claim: the catch-up once the lag reaches half the bound
//! (the other half is for applying the job), or a quarter of it while the idle threads are
//! starved (a probe was late in the last ten bounds: nobody else will apply the jobs, and the
//! catch-up must also work off what queued meanwhile), until the lag has stayed under a
//! quarter of the bound and the idle threads have answered every probe promptly for ten
//! bounds. While they are starved and the lag is still smaller, neither claims, so the idle
//! loop cannot lease jobs it would then hold for seconds, blocking their sessions for the
//! catch-up; the runs it already holds then go to the catch-up (see `super::held`).
//!
//! The ten bounds are for other processes, which give the idle threads moments of CPU and take
//! them back. A late probe while this process itself used nearly all of its cores ([`OwnCpu`]:
//! its requests, a cold memory decoded for one) says nothing of them: when every late look of
//! the last ten bounds was such, both holds are one bound. A cold start's stall, a few hundred
//! ms decoding a 10,000-turn memory, otherwise held the catch-up at normal priority for twenty
//! seconds, the whole of a 20 s run, with the added p99 at 200 req/s 8.5–10.6 ms against 4.1
//! (`./benches/history.sh`, 2026-12-06).

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use engram_runtime::priority::process_cpu_time;

use crate::recorder::ids::turn_time_micros;

/// How often the monitor looks at the queue and probes the idle threads.
pub const TICK: Duration = Duration::from_millis(100);

/// The idle threads count as starved when a probe waits longer than this to run. An idle
/// thread with a free core wakes in microseconds; one behind a busy core waits for seconds.
pub const PROMPT: Duration = Duration::from_millis(50);

/// How many bounds the calm must last before the catch-up stops, and how long the idle threads
/// count as starved after a late probe. They get moments of CPU under contention too (another
/// process blocking briefly), and a job they lease in one may then wait seconds for the next,
/// its session blocked for the catch-up: a short hold let that happen every few seconds.
const HOLD_BOUNDS: u32 = 10;

/// A late look counts as this process's own doing when it used at least this share of its
/// cores meanwhile.
pub const OWN_BUSY: f64 = 0.8;

/// Which claim loop may claim jobs now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claimer {
    /// The worker at idle priority: requests come first.
    Idle,
    /// The catch-up at normal priority: the lag reached the bound's half (a quarter, with the
    /// idle threads starved).
    CatchUp,
    /// Neither: the idle threads are starved but the jobs can still wait.
    Neither,
}

/// Decides who claims from the estimated lag and the idle threads' health, with hysteresis so
/// the catch-up does not flap on and off with every job.
#[derive(Debug)]
pub struct LagGate {
    engage: Duration,
    /// The lag at which the catch-up starts while the idle threads are starved: at half the
    /// bound, a backlog that queued meanwhile pushed the jobs behind it past the bound
    /// (`./benches/history.sh --busy-cores --rate 100`, 2026-12-05).
    engage_starved: Duration,
    release: Duration,
    /// How long the calm must last before the catch-up stops.
    hold: Duration,
    engaged: bool,
    calm_since: Option<Instant>,
    /// When a late look last came while this process kept its cores busy itself, and when one
    /// last came while it did not (another process's doing).
    own_late_at: Option<Instant>,
    other_late_at: Option<Instant>,
}

impl LagGate {
    pub fn new(max_lag: Duration) -> LagGate {
        LagGate {
            engage: max_lag / 2,
            engage_starved: max_lag / 4,
            release: max_lag / 4,
            hold: max_lag * HOLD_BOUNDS,
            engaged: false,
            calm_since: None,
            own_late_at: None,
            other_late_at: None,
        }
    }

    /// Who may claim, given the estimated lag and whether a probe of the idle threads just
    /// found them starved (which counts for the hold after it was seen), and if so whether this
    /// process kept its cores busy itself meanwhile (`own`).
    pub fn update(&mut self, lag: Duration, starved_now: bool, own: bool, now: Instant) -> Claimer {
        if starved_now {
            if own {
                self.own_late_at = Some(now);
            } else {
                self.other_late_at = Some(now);
            }
        }
        let hold = self.hold(now);
        let starved = self.starved(now);
        if !self.engaged {
            let engage = if starved {
                self.engage_starved
            } else {
                self.engage
            };
            self.engaged = lag >= engage;
            self.calm_since = None;
        } else if lag < self.release && !starved {
            let since = *self.calm_since.get_or_insert(now);
            if now.saturating_duration_since(since) >= hold {
                self.engaged = false;
                self.calm_since = None;
            }
        } else {
            self.calm_since = None;
        }
        match (self.engaged, starved) {
            (true, _) => Claimer::CatchUp,
            (false, true) => Claimer::Neither,
            (false, false) => Claimer::Idle,
        }
    }

    /// Whether the lag is a quarter of the bound or more: over what the catch-up's calm allows.
    pub fn behind(&self, lag: Duration) -> bool {
        lag >= self.release
    }

    /// Whether the idle threads count as starved: a probe was late within the last ten bounds
    /// (one, when every late look of the last ten was this process's own doing).
    pub fn starved(&self, now: Instant) -> bool {
        let hold = self.hold(now);
        // The last late look, whoever's doing it was.
        self.own_late_at
            .max(self.other_late_at)
            .is_some_and(|at| now.saturating_duration_since(at) < hold)
    }

    /// The calm the catch-up needs, and how long the idle threads count as starved after a
    /// late look: ten bounds, or one when every late look of the last ten bounds came while
    /// this process kept its cores busy itself.
    fn hold(&self, now: Instant) -> Duration {
        let recent = |at: Option<Instant>| {
            at.is_some_and(|at| now.saturating_duration_since(at) < self.hold)
        };
        if recent(self.own_late_at) && !recent(self.other_late_at) {
            self.hold / HOLD_BOUNDS
        } else {
            self.hold
        }
    }
}

/// What the monitor knows of the queue's progress; both claim loops report applied jobs.
#[derive(Debug)]
pub struct Progress(Mutex<Seen>);

#[derive(Debug)]
struct Seen {
    /// The last sign of progress: a job applied, the queue seen empty or shorter.
    mark: Instant,
    /// The last applied job's lag; zero once the queue was seen empty after it.
    behind: Duration,
    depth: u64,
}

impl Default for Progress {
    fn default() -> Self {
        Progress::new(Instant::now())
    }
}

impl Progress {
    pub fn new(now: Instant) -> Progress {
        Progress(Mutex::new(Seen {
            mark: now,
            behind: Duration::ZERO,
            depth: 0,
        }))
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A job was applied `lag` after its request arrived.
    pub fn applied(&self, lag: Duration, now: Instant) {
        let mut seen = self.seen();
        seen.mark = now;
        seen.behind = lag;
    }

    /// The lag of the oldest waiting job, as far as one look at the queue's depth tells: a
    /// lower bound when jobs were applied meanwhile, never less than the last one's lag.
    /// Progress made by other processes shows only as a shorter queue.
    pub fn estimate(&self, depth: u64, now: Instant) -> Duration {
        let mut seen = self.seen();
        if depth == 0 {
            seen.behind = Duration::ZERO;
        }
        if depth < seen.depth || depth == 0 {
            seen.mark = now;
        }
        seen.depth = depth;
        now.saturating_duration_since(seen.mark).max(seen.behind)
    }
}

/// The CPU this process used, as a share of the cores it may run on, between two looks.
#[derive(Debug)]
pub struct OwnCpu {
    last: Option<(Instant, Duration)>,
    cores: f64,
}

impl Default for OwnCpu {
    fn default() -> Self {
        OwnCpu {
            last: None,
            cores: std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64),
        }
    }
}

impl OwnCpu {
    /// The share of its cores (affinity and CPU quota) the process used since the last look,
    /// `0..=1`; `None` at the first look, or where the process's CPU clock cannot be read.
    pub fn share(&mut self, now: Instant) -> Option<f64> {
        let used = process_cpu_time();
        let last = std::mem::replace(&mut self.last, used.map(|used| (now, used)));
        let ((then, before), used) = (last?, used?);
        let elapsed = now.saturating_duration_since(then).as_secs_f64();
        (elapsed > 0.0).then(|| used.saturating_sub(before).as_secs_f64() / (elapsed * self.cores))
    }
}

/// How long ago the request of a turn id this proxy made arrived; `None` for other ids.
pub fn turn_lag(turn_id: &str) -> Option<Duration> {
    let made = turn_time_micros(turn_id)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?;
    // Clock skew between the proxy that made the id and this one: no lag.
    Some(now.saturating_sub(Duration::from_micros(made)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUND: Duration = Duration::from_millis(1000);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_catch_up_starts_at_half_the_bound_and_stops_after_ten_calm_bounds() {
        let start = Instant::now();
        let at = |n: u64| start + ms(n);
        let mut gate = LagGate::new(BOUND);
        assert_eq!(gate.update(ms(0), false, false, at(0)), Claimer::Idle);
        assert_eq!(gate.update(ms(499), false, false, at(100)), Claimer::Idle);
        assert_eq!(
            gate.update(ms(500), false, false, at(200)),
            Claimer::CatchUp
        );
        // Between a quarter and a half of the bound it keeps going: hysteresis.
        assert_eq!(
            gate.update(ms(300), false, false, at(300)),
            Claimer::CatchUp
        );
        // Calm from 400 ms on; ten bounds later it stops.
        assert_eq!(
            gate.update(ms(100), false, false, at(400)),
            Claimer::CatchUp
        );
        assert_eq!(
            gate.update(ms(100), false, false, at(10_399)),
            Claimer::CatchUp
        );
        assert_eq!(
            gate.update(ms(100), false, false, at(10_400)),
            Claimer::Idle
        );
        // And starts again only at half the bound.
        assert_eq!(
            gate.update(ms(400), false, false, at(10_500)),
            Claimer::Idle
        );
    }

    #[test]
    fn a_lag_spike_or_starved_idle_threads_restart_the_calm() {
        let start = Instant::now();
        let at = |n: u64| start + ms(n);
        let mut gate = LagGate::new(BOUND);
        assert_eq!(gate.update(ms(600), false, false, at(0)), Claimer::CatchUp);
        assert_eq!(gate.update(ms(0), false, false, at(100)), Claimer::CatchUp);
        // Over a quarter of the bound: the calm starts again.
        assert_eq!(
            gate.update(ms(250), false, false, at(9_000)),
            Claimer::CatchUp
        );
        assert_eq!(
            gate.update(ms(0), false, false, at(9_100)),
            Claimer::CatchUp
        );
        assert_eq!(
            gate.update(ms(0), false, false, at(19_099)),
            Claimer::CatchUp
        );
        // Starved idle threads too, even with the queue caught up: they could not take over.
        assert_eq!(
            gate.update(ms(0), true, false, at(19_099)),
            Claimer::CatchUp
        );
        // And they count as starved for ten bounds after the last late probe.
        assert_eq!(
            gate.update(ms(0), false, false, at(19_200)),
            Claimer::CatchUp
        );
        assert_eq!(
            gate.update(ms(0), false, false, at(29_098)),
            Claimer::CatchUp
        );
        // Calm from 29,099 on.
        assert_eq!(
            gate.update(ms(0), false, false, at(29_099)),
            Claimer::CatchUp
        );
        assert_eq!(
            gate.update(ms(0), false, false, at(39_098)),
            Claimer::CatchUp
        );
        assert_eq!(gate.update(ms(0), false, false, at(39_099)), Claimer::Idle);
    }

    #[test]
    fn starved_idle_threads_claim_nothing_until_the_lag_calls_for_the_catch_up() {
        let start = Instant::now();
        let at = |n: u64| start + ms(n);
        let mut gate = LagGate::new(BOUND);
        assert_eq!(gate.update(ms(0), true, false, at(0)), Claimer::Neither);
        assert_eq!(
            gate.update(ms(200), false, false, at(200)),
            Claimer::Neither
        );
        // A prompt probe now and then does not hand the jobs back to them.
        assert_eq!(
            gate.update(ms(0), false, false, at(9_999)),
            Claimer::Neither
        );
        assert_eq!(gate.update(ms(0), false, false, at(10_000)), Claimer::Idle);
        // Fed, the idle threads keep the jobs up to half the bound...
        assert_eq!(
            gate.update(ms(300), false, false, at(10_100)),
            Claimer::Idle
        );
        // ...starved, the catch-up takes them from a quarter of it.
        assert_eq!(
            gate.update(ms(100), true, false, at(10_200)),
            Claimer::Neither
        );
        assert_eq!(
            gate.update(ms(249), false, false, at(10_300)),
            Claimer::Neither
        );
        assert_eq!(
            gate.update(ms(250), false, false, at(10_400)),
            Claimer::CatchUp
        );
        assert!(!gate.behind(ms(249)) && gate.behind(ms(250)));
    }

    #[test]
    fn the_lag_is_the_time_without_progress_or_the_last_jobs_lag() {
        let start = Instant::now();
        let at = |n: u64| start + ms(n);
        let progress = Progress::new(start);
        assert_eq!(progress.estimate(0, at(100)), ms(0));
        // Work waits from the last look that saw the queue empty.
        assert_eq!(progress.estimate(2, at(200)), ms(100));
        assert_eq!(progress.estimate(3, at(700)), ms(600));
        // A shorter queue is progress (made here or by another process).
        assert_eq!(progress.estimate(1, at(800)), ms(0));
        assert_eq!(progress.estimate(1, at(900)), ms(100));
        // An applied job is progress, but the queue is as late as that job was.
        progress.applied(ms(700), at(950));
        assert_eq!(progress.estimate(1, at(1000)), ms(700));
        assert_eq!(progress.estimate(1, at(1800)), ms(850));
        // Until the queue is seen empty.
        assert_eq!(progress.estimate(0, at(1900)), ms(0));
        assert_eq!(progress.estimate(1, at(2000)), ms(100));
    }

    #[test]
    fn turn_lag_reads_the_turn_ids_time() {
        let made = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|now| now.saturating_sub(ms(1500)).as_micros())
            .unwrap_or_default();
        let lag = turn_lag(&format!("t{made:x}-0000abcd-1"));
        assert!(
            lag.is_some_and(|lag| lag >= ms(1500) && lag < ms(60_000)),
            "{lag:?}"
        );
        assert_eq!(turn_lag("turn-1"), None);
        // A turn made in the future (another proxy's clock): no lag.
        let future = u128::from(u64::MAX >> 8);
        assert_eq!(turn_lag(&format!("t{future:x}-0-1")), Some(Duration::ZERO));
    }

    /// Late looks while this process kept its cores busy itself (its requests, a cold memory
    /// decoded for one) hold for a bound, not ten: starved for a bound after the last, then a
    /// bound of calm.
    #[test]
    fn late_probes_of_the_process_own_doing_hold_for_one_bound() {
        let start = Instant::now();
        let at = |n: u64| start + ms(n);
        let mut gate = LagGate::new(BOUND);
        assert_eq!(gate.update(ms(0), true, true, at(0)), Claimer::Neither);
        assert_eq!(gate.update(ms(300), true, true, at(100)), Claimer::CatchUp);
        assert!(gate.starved(at(1_099)));
        assert!(!gate.starved(at(1_100)));
        // Calm from 1,100 on, for a bound.
        assert_eq!(
            gate.update(ms(0), false, false, at(1_100)),
            Claimer::CatchUp
        );
        assert_eq!(
            gate.update(ms(0), false, false, at(2_099)),
            Claimer::CatchUp
        );
        assert_eq!(gate.update(ms(0), false, false, at(2_100)), Claimer::Idle);
    }

    /// One late look of another process's doing in the last ten bounds brings the ten-bound
    /// holds back, whatever the process itself did since; once it is ten bounds old, the
    /// process's own look holds for a bound again.
    #[test]
    fn a_late_probe_of_another_process_keeps_the_ten_bound_holds() {
        let start = Instant::now();
        let at = |n: u64| start + ms(n);
        let mut gate = LagGate::new(BOUND);
        assert_eq!(gate.update(ms(300), true, false, at(0)), Claimer::CatchUp);
        assert_eq!(gate.update(ms(0), true, true, at(100)), Claimer::CatchUp);
        // The process's own look alone would have let go at 1,100.
        assert!(gate.starved(at(1_200)));
        assert!(gate.starved(at(9_999)));
        assert_eq!(
            gate.update(ms(0), false, false, at(9_999)),
            Claimer::CatchUp
        );
        assert!(!gate.starved(at(10_000)));
        // Calm from 10,000 on; no late look is recent by 10,100, so ten bounds of it.
        assert_eq!(
            gate.update(ms(0), false, false, at(10_000)),
            Claimer::CatchUp
        );
        assert_eq!(
            gate.update(ms(0), false, false, at(19_999)),
            Claimer::CatchUp
        );
        assert_eq!(gate.update(ms(0), false, false, at(20_000)), Claimer::Idle);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_process_share_of_its_cores_counts_its_own_work() {
        let mut own = OwnCpu::default();
        let start = Instant::now();
        assert_eq!(own.share(start), None);
        let mut spun = 0u64;
        while start.elapsed() < ms(300) {
            spun = std::hint::black_box(spun.wrapping_add(1));
        }
        let share = own.share(Instant::now());
        assert!(share.is_some_and(|share| share > 0.0), "{share:?}");
    }
}
