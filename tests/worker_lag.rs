//! The update path's lag stays bounded when every core is busy with other processes (issue 27):
//! the idle-priority worker then gets no CPU, and the catch-up (`worker.max_lag_ms`) applies
//! the jobs at normal priority. Run with `ENGRAM_WORKER__MAX_LAG_MS=0` in the environment (the
//! proxy inherits it) to see the test fail without the catch-up. It means something only at
//! nice 0 (as `scripts/test.sh` runs it): under `nice -n 19` the busy loops are niced too, and
//! against nice 19 an idle-policy thread gets a sixth of a core, enough to keep up alone.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    reason = "tests: a failure should fail the test loudly; the measured lags are printed"
)]

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::memory::{recorded, say, wait_applied};
use common::redis::{RedisServer, store_env};
use common::{Process, mock, proxy, send, temp_path};

/// One user's conversation: 300 turns at 20 a second. Without the catch-up, 22-59 of 60 waited
/// over a second (six runs, 2026-12-06), and 152 of the 155 applied of 300 (2026-12-07); at 2
/// a second the idle worker of an optimised build kept up alone. Over 60 turns the p99 was the
/// slowest job, and one job over a second failed about one run in thirty; over 300 the p99
/// allows three.
const TURNS: u32 = 300;
const TURN_EVERY: Duration = Duration::from_millis(50);

/// CPU-bound processes at normal priority, one per core; killed on drop, and each ends by itself
/// after 60 s should the test die without dropping them.
struct BusyCores(Vec<Child>);

impl BusyCores {
    fn start() -> BusyCores {
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        // Pure shell arithmetic, with a look at the clock every 20,000 rounds.
        let script = "i=0; end=$(( $(date +%s) + 60 )); while :; do i=$((i+1)); \
                      if [ $i -ge 20000 ]; then i=0; [ $(date +%s) -ge $end ] && exit 0; fi; done";
        let children = (0..cores)
            .map(|_| {
                Command::new("sh")
                    .args(["-c", script])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start a busy loop")
            })
            .collect();
        BusyCores(children)
    }
}

impl Drop for BusyCores {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The value of one unlabelled series (or one written out with its labels) on `/metrics`.
async fn metric(proxy: &Process, series: &str) -> f64 {
    let reply = send("GET", &proxy.url("/metrics"), &[], "").await;
    let page = String::from_utf8(reply.body.to_vec()).unwrap();
    page.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Jobs applied so far, jobs observed over 1 s of lag, those by the catch-up, and the idle
/// loop's runs the catch-up took over.
async fn lags(proxy: &Process) -> [f64; 4] {
    let applied = metric(proxy, "engram_job_lag_seconds_count").await;
    let within = metric(proxy, "engram_job_lag_seconds_bucket{le=\"1\"}").await;
    let catch_up = metric(proxy, "engram_worker_catch_up_jobs_total").await;
    let taken_over = metric(proxy, "engram_worker_taken_over_runs_total").await;
    [applied, applied - within, catch_up, taken_over]
}

/// The job lag histogram's cumulative buckets up to 5 s.
async fn buckets(proxy: &Process) -> Vec<(&'static str, f64)> {
    let mut counts = Vec::new();
    for le in ["0.1", "0.25", "0.5", "1", "2.5", "5"] {
        let series = format!("engram_job_lag_seconds_bucket{{le=\"{le}\"}}");
        counts.push((le, metric(proxy, &series).await));
    }
    counts
}

#[tokio::test]
async fn job_lag_stays_under_a_second_while_other_processes_keep_every_core_busy() {
    lag_stays_bounded("embedded", &[], TURNS, TURN_EVERY).await;
}

/// The same on Redis: a catch-up that took a short claim for a caught-up queue and waited before
/// the next one applied one user's turns at ten a second.
#[tokio::test]
async fn job_lag_stays_under_a_second_on_redis_while_other_processes_keep_every_core_busy() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let url = redis.url();
    lag_stays_bounded("redis", &store_env(&url), TURNS, TURN_EVERY).await;
}

/// One user says `turns` things, one every `every`, to a proxy started with `env` while a busy
/// loop runs on every core: every job is applied within a second of its turn, and every
/// prompt carries the exchange before it. One at a time: two would each be the other's load.
async fn lag_stays_bounded(name: &str, env: &[(&str, &str)], turns: u32, every: Duration) {
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _alone = ONE_AT_A_TIME.lock().await;
    let record = temp_path(&format!("worker-lag-{name}.jsonl"));
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let proxy = proxy(&upstream.address, env);
    // The first request loads the tokenizers; not part of the measured conversation.
    let warm = say(
        &proxy,
        "default",
        "warm-up",
        "s",
        "Hello, I live in Lisbon.",
    )
    .await;
    wait_applied(&proxy, "default", "warm-up", &warm).await;
    // The worker observes a job's lag after its commit, which `wait_applied` sees: wait for the
    // observation too, or the warm-up's (often over a second) lands in the measured turns.
    let deadline = Instant::now() + Duration::from_secs(5);
    while lags(&proxy).await[0] < 1.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let [before, before_late, before_catch_up, before_taken] = lags(&proxy).await;
    let buckets_before = buckets(&proxy).await;

    let busy = BusyCores::start();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = tokio::time::Instant::now();
    // A paragraph a turn, as people write to an assistant: each job is some milliseconds of
    // the engine's work, which an idle-priority thread on a busy core does not get.
    let said = |turn: u32| {
        let details: String = (0..12)
            .map(|n| {
                format!(
                    " On day {n} there I walked to district {} and ate dish {}.",
                    turn * 7 + n,
                    turn * 3 + n
                )
            })
            .collect();
        format!("Turn {turn}: I visited city number {turn} and liked its museum.{details}")
    };
    let mut answers = Vec::new();
    for turn in 0..turns {
        tokio::time::sleep_until(started + every * turn).await;
        let reply = say(&proxy, "default", "traveller", "trip", &said(turn)).await;
        answers.push(reply.json()["choices"][0]["message"]["content"].clone());
    }
    let talked = started.elapsed();

    // Every turn's job is applied within the bound of its arrival, so a few seconds after the
    // last turn they all are; one still waiting counts as late.
    let deadline = Instant::now() + Duration::from_secs(5);
    let [applied, late, catch_up, taken_over] = loop {
        let [applied, late, catch_up, taken_over] = lags(&proxy).await;
        let applied = applied - before;
        if applied >= f64::from(turns) || Instant::now() > deadline {
            let taken_over = taken_over - before_taken;
            break [
                applied,
                late - before_late,
                catch_up - before_catch_up,
                taken_over,
            ];
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let spread: Vec<String> = buckets(&proxy)
        .await
        .iter()
        .zip(&buckets_before)
        .map(|((le, now), (_, then))| format!("le {le}: {}", now - then))
        .collect();
    drop(busy);
    let waiting = f64::from(turns) - applied;
    println!(
        "{turns} turns in {talked:?}: applied {applied}, over 1 s {late}, still waiting {waiting}, \
         by the catch-up {catch_up} (runs taken over from the idle loop {taken_over}); lag buckets (cumulative): {spread:?}"
    );
    // p99: at most one job in a hundred over a second.
    let moves: Vec<String> = proxy
        .log_events("update path: claims moved")
        .iter()
        .map(|event| event["fields"].to_string())
        .collect();
    assert!(
        late + waiting <= f64::from(turns) * 0.01,
        "jobs over 1 s of lag: {late} applied, {waiting} not applied; claims moved: {moves:#?}"
    );
    // And whatever the worker's lag, each prompt's raw window ends with the previous exchange.
    let prompts: Vec<serde_json::Value> = recorded(&record)
        .into_iter()
        .filter(|prompt| prompt.to_string().contains("I visited city number"))
        .collect();
    assert_eq!(prompts.len(), turns as usize);
    for (turn, prompt) in prompts.iter().enumerate().skip(1) {
        // The conversation without engram's blocks (the recall block sits before the question).
        let messages: Vec<&serde_json::Value> = prompt["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|message| message["role"] != "system")
            .collect();
        let n = messages.len();
        assert!(n >= 3, "turn {turn}: {prompt}");
        assert_eq!(messages[n - 1]["content"], said(turn as u32).as_str());
        assert_eq!(messages[n - 3]["role"], "user", "turn {turn}: {prompt}");
        assert_eq!(messages[n - 3]["content"], said(turn as u32 - 1).as_str());
        assert_eq!(
            messages[n - 2]["role"],
            "assistant",
            "turn {turn}: {prompt}"
        );
        assert_eq!(messages[n - 2]["content"], answers[turn - 1]);
    }
}
