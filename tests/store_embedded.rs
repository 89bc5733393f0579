//! The embedded (redb) store: the shared store suite, plus crash safety.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failure should fail the test loudly"
)]

mod store_suite;

use std::process::Command;
use std::time::Duration;

use engram::store::{EmbeddedStore, Enqueued, JobState, Store, UserKey};
use tempfile::TempDir;

use store_suite::{exchange, job, state_with};

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
    assert_eq!(hot.state, Some(expected));
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

#[tokio::test]
async fn killed_process_loses_no_committed_write() {
    let dir = tempfile::tempdir().unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--test-threads", "1"])
        .env(CHILD_DIR, dir.path())
        .output()
        .unwrap();
    assert!(
        !child.status.success(),
        "the child should have aborted: {}",
        String::from_utf8_lossy(&child.stdout)
    );

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
