//! The embedded (redb) store: the shared store suite, plus crash safety.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests: a failure should fail the test loudly"
)]

mod store_suite;

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use engram_store::{
    CommitListener, EmbeddedStore, EncodedState, Enqueued, JobQueue, JobState, MemoryRecords,
    Store, UserKey,
};
use tempfile::TempDir;

use store_suite::{RacedCommits, exchange, job, race_two_commits, state_with};

async fn fresh_store() -> (EmbeddedStore, TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    (store, dir)
}

store_suite!(fresh_store);

/// Writes one record of each kind, as a recorded turn would.
async fn write_turn(store: &EmbeddedStore, user: &UserKey) {
    let state = state_with(&["I'm allergic to peanuts."]);
    store.save_state(user, &state, 0).await.unwrap();
    store
        .append_raw(
            user,
            "x1",
            &exchange("s1", "x1", "I'm allergic to peanuts."),
        )
        .await
        .unwrap();
    assert_eq!(
        store.enqueue(&job(user, "hash-1")).await.unwrap(),
        Enqueued::Queued
    );
}

async fn assert_turn_survived(store: &EmbeddedStore, user: &UserKey) {
    let expected = state_with(&["I'm allergic to peanuts."]);
    let hot = store.hot_record(user, "s1", None).await.unwrap();
    assert_eq!(hot.version, expected.version);
    let Some(engram_store::MemoryUpdate::Whole(state)) = hot.update else {
        panic!("a cold read did not bring the whole memory");
    };
    assert_eq!(*state, expected);
    assert_eq!(store.read_raw(user).await.unwrap().len(), 1);
    assert_eq!(store.queue_depth().await.unwrap(), 1);
    let id = job(user, "hash-1").id;
    assert_eq!(store.job_state(&id).await.unwrap(), Some(JobState::Queued));
}

#[tokio::test]
async fn reopened_file_keeps_committed_writes() {
    let dir = tempfile::tempdir().unwrap();
    let user = UserKey::new("acme", "alice");
    {
        let store = EmbeddedStore::open(dir.path()).unwrap();
        write_turn(&store, &user).await;
    }
    let store = EmbeddedStore::open(dir.path()).unwrap();
    assert_eq!(store.path(), Some(dir.path().join("engram.redb").as_path()));
    assert_turn_survived(&store, &user).await;
}

/// A warm hot-path read (the caller's state cached at the current version) runs on the
/// caller's thread, so its future is ready at the first poll; with a stale cached version it
/// goes to a blocking thread and still returns the state.
#[tokio::test]
async fn a_warm_hot_record_is_read_in_place_and_a_stale_one_brings_the_state() {
    let (store, _dir) = fresh_store().await;
    let user = UserKey::new("acme", "alice");
    write_turn(&store, &user).await;
    let version = store.hot_record(&user, "s1", None).await.unwrap().version;
    assert_ne!(version, 0);

    let mut warm = store.hot_record(&user, "s1", Some(version));
    let polled = warm.as_mut().poll(&mut Context::from_waker(Waker::noop()));
    let Poll::Ready(Ok(record)) = polled else {
        panic!("a warm read did not finish at its first poll");
    };
    assert_eq!(record.version, version);
    assert!(record.update.is_none());

    let stale = store
        .hot_record(&user, "s1", Some(version.wrapping_add(1)))
        .await
        .unwrap();
    assert_eq!(stale.version, version);
    // A version the change ring does not lead from reads the whole memory.
    let Some(engram_store::MemoryUpdate::Whole(state)) = stale.update else {
        panic!("a stale read did not bring the whole memory");
    };
    assert_eq!(*state, state_with(&["I'm allergic to peanuts."]));
}

/// What a commit listener was told: (user, expected version, state written).
#[derive(Default)]
struct Heard(Mutex<Vec<(UserKey, u64, EncodedState)>>);

impl CommitListener for Heard {
    fn committed(&self, user: &UserKey, expected_version: u64, state: &EncodedState) {
        // Slow on purpose: a store that answered the commit before telling the listener would
        // let the commit return before this records it.
        std::thread::sleep(Duration::from_millis(50));
        self.0
            .lock()
            .unwrap()
            .push((user.clone(), expected_version, state.clone()));
    }
}

/// Two job commits of one user from the same version (one group commit, or two): the
/// listener is told of the one that won, with what it wrote, before that commit is answered
/// (so the hot path's cache holds a memory before the writer hears it committed), and never
/// of the one that lost its version check, nor of a plain state save.
#[tokio::test]
async fn the_commit_listener_hears_the_winning_commit_before_it_is_answered() {
    let dir = tempfile::tempdir().unwrap();
    let heard = Arc::new(Heard::default());
    let store = EmbeddedStore::open(dir.path())
        .unwrap()
        .with_commit_listener(Arc::clone(&heard) as Arc<dyn CommitListener>);
    let RacedCommits {
        user: alice,
        base_version,
        commits: [(_, left_state), (_, right_state)],
        results: [left, right],
    } = race_two_commits(&store).await;
    assert!(
        left.is_ok() != right.is_ok(),
        "one commit wins: {left:?} {right:?}"
    );
    let won = if left.is_ok() {
        left_state
    } else {
        right_state
    };
    assert_eq!(
        *heard.0.lock().unwrap(),
        vec![(alice, base_version, won.clone())]
    );
}

/// Set in the child process: the data directory to write into before aborting.
const CHILD_DIR: &str = "ENGRAM_STORE_CRASH_CHILD_DIR";

/// The child half of `killed_process_loses_no_committed_write`: writes, then dies without any
/// clean-up (no destructors, no flush), as a SIGKILL would leave it. A no-op in a normal run.
#[tokio::test]
async fn crash_child() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else {
        return;
    };
    let store = EmbeddedStore::open(std::path::Path::new(&dir)).unwrap();
    write_turn(&store, &UserKey::new("acme", "alice")).await;
    std::process::abort();
}

/// Runs the test `child` of this binary in a process of its own, with `var` naming `dir`, and
/// checks that it aborted.
fn run_crash_child(child: &str, var: &str, dir: &std::path::Path) {
    let output = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", child, "--test-threads", "1"])
        .env(var, dir)
        .output()
        .unwrap();
    assert!(
        !output.status.success(),
        "the child should have aborted: {}",
        String::from_utf8_lossy(&output.stdout)
    );
}

#[tokio::test]
async fn killed_process_loses_no_committed_write() {
    let dir = tempfile::tempdir().unwrap();
    run_crash_child("crash_child", CHILD_DIR, dir.path());

    let store = EmbeddedStore::open(dir.path()).unwrap();
    assert_turn_survived(&store, &UserKey::new("acme", "alice")).await;
    // The job a dead process queued is still claimable.
    let claimed = store
        .claim("worker-a", Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claimed.attempt, 1);
}

/// Set in the child process: the data directory to apply a job in before aborting.
const JOB_CHILD_DIR: &str = "ENGRAM_STORE_JOB_CRASH_CHILD_DIR";

/// The child half of `a_job_commit_survives_a_crash_right_after_it_returns`: queues a job,
/// applies it (a job commit), then dies as a SIGKILL would leave it.
#[tokio::test]
async fn job_crash_child() {
    let Some(dir) = std::env::var_os(JOB_CHILD_DIR) else {
        return;
    };
    let store = EmbeddedStore::open(std::path::Path::new(&dir)).unwrap();
    let user = UserKey::new("acme", "alice");
    let job = job(&user, "hash-1");
    assert_eq!(store.enqueue(&job).await.unwrap(), Enqueued::Queued);
    store
        .claim("worker-a", Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    let state = state_with(&["I'm allergic to peanuts."]);
    store
        .commit_jobs(
            std::slice::from_ref(&job),
            &EncodedState::of(&state).unwrap(),
            0,
            &[],
        )
        .await
        .unwrap();
    std::process::abort();
}

/// A job commit is durable when it returns: a process killed just after one leaves the job
/// applied, its raw turn written and nothing queued, so no worker applies it twice.
#[tokio::test]
async fn a_job_commit_survives_a_crash_right_after_it_returns() {
    let dir = tempfile::tempdir().unwrap();
    run_crash_child("job_crash_child", JOB_CHILD_DIR, dir.path());
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let user = UserKey::new("acme", "alice");
    let id = job(&user, "hash-1").id;
    assert_eq!(store.job_state(&id).await.unwrap(), Some(JobState::Applied));
    assert_eq!(store.read_raw(&user).await.unwrap().len(), 1);
    assert_eq!(store.queue_depth().await.unwrap(), 0);
}

/// Enqueues commit on the store's write thread (which the job commits share), off the threads
/// serving requests, at normal priority (`SCHED_OTHER`, nice 0: a lower priority would let a
/// busy core starve it); and enqueues arriving together still each get their own answer.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn enqueues_commit_on_the_stores_normal_priority_write_thread() {
    let (store, _dir) = fresh_store().await;
    let store = std::sync::Arc::new(store);
    let user = UserKey::new("t", "recorded");
    let mut enqueues = tokio::task::JoinSet::new();
    for n in 0..8 {
        let store = std::sync::Arc::clone(&store);
        let job = job(&user, &format!("job-{n}"));
        enqueues.spawn(async move { store.enqueue(&job).await });
    }
    for answer in enqueues.join_all().await {
        assert_eq!(answer.unwrap(), Enqueued::Queued);
    }
    assert_eq!(store.queue_depth().await.unwrap(), 8);
    // (policy, nice): fields 41 and 19 of a thread's stat line. Fields after the command's
    // closing parenthesis start at field 3 (state).
    let scheduling = |stat: &str| {
        let after: Vec<&str> = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        let field = |n: usize| after[n - 3].parse::<i32>().unwrap();
        (field(41), field(19))
    };
    let mut recorder_scheduling = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let path = task.unwrap().path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if comm.trim() == "engram-writer" {
            let stat = std::fs::read_to_string(path.join("stat")).unwrap();
            recorder_scheduling.push(scheduling(&stat));
        }
    }
    assert!(!recorder_scheduling.is_empty(), "no engram-writer thread");
    // Not lowered: as this test's thread (nice 0 unless the tests run niced).
    let own = scheduling(&std::fs::read_to_string("/proc/thread-self/stat").unwrap());
    assert!(
        recorder_scheduling.iter().all(|&recorder| recorder == own),
        "(policy, nice) {recorder_scheduling:?}, not {own:?}"
    );
}

/// A store file written by engram 0.1 before the item layout (`tests/data/store-0.1`: two
/// users, four turns each, recorded through the proxy and applied by its worker) opens, its
/// memories converted: every turn is still there, the rows are items and hot states, and the
/// next write and read work by changes.
#[tokio::test]
async fn a_store_written_by_the_earlier_layout_is_converted_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/store-0.1");
    std::fs::copy(
        fixture.join(engram_store::embedded::FILE_NAME),
        dir.path().join(engram_store::embedded::FILE_NAME),
    )
    .unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let mut states = Vec::new();
    for name in ["alice", "bob"] {
        let user = UserKey::new("default", name);
        let state = store.load_state(&user).await.unwrap().unwrap();
        assert_eq!(state.raw_turns.len(), 4, "{name}");
        assert!(state.raw_turns[0].user.contains(name), "{name}");
        assert!(
            state
                .facts
                .iter()
                .any(|fact| fact.text().contains("peanut"))
        );
        states.push((user, state));
    }
    drop(store);
    let rows = EmbeddedStore::dump(dir.path()).unwrap();
    let hot_states: Vec<_> = rows
        .iter()
        .filter(|row| row.table == "memory_state")
        .collect();
    assert_eq!(hot_states.len(), 2);
    for row in hot_states {
        let meta: serde_json::Value = serde_json::from_slice(&row.value).unwrap();
        assert_eq!(meta["layout"], 2, "{meta}");
        assert!(meta.get("raw_turns").is_none());
    }
    assert!(
        rows.iter()
            .filter(|row| row.table == "memory_items")
            .count()
            >= 2 * 4 * 2
    );

    // Opening again converts nothing more, and the memory goes on by changes.
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let (user, mut state) = states.remove(0);
    let before = state.version;
    engram_memory::record_exchange(
        &mut state,
        &exchange("s1", "after-upgrade", "I moved to Lisbon."),
        &engram_memory::HeuristicExtractor,
        &engram_memory::MemoryConfig::default(),
    );
    let changes = state.take_changes();
    let encoded = engram_store::EncodedState::changes(&state, &changes).unwrap();
    store
        .save_encoded_state(&user, &encoded, before)
        .await
        .unwrap();
    let hot = store.hot_record(&user, "s1", Some(before)).await.unwrap();
    assert!(matches!(
        hot.update,
        Some(engram_store::MemoryUpdate::Delta(_))
    ));
    let mut loaded = store.load_state(&user).await.unwrap().unwrap();
    loaded.take_changes();
    state.take_changes();
    assert_eq!(loaded, state);
}
