//! The management API fuzzed from its own OpenAPI document with schemathesis: every generated
//! request (valid, invalid, and stateful sequences) must get an answer that is not a 5xx.
//!
//! The README's test command installs schemathesis in its venv and sets `ENGRAM_TEST_PYTHON`;
//! without that venv the test skips, saying why. A longer run:
//! `ENGRAM_SCHEMATHESIS_EXAMPLES=500 cargo test --test schemathesis`.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::memory::say;
use common::{ADMIN_TOKEN, mock, proxy};

/// The `schemathesis` command beside the test venv's Python.
fn schemathesis() -> Option<PathBuf> {
    let python = PathBuf::from(std::env::var("ENGRAM_TEST_PYTHON").ok()?);
    let command = python.parent()?.join("schemathesis");
    command.exists().then_some(command)
}

#[tokio::test]
async fn the_management_api_answers_every_generated_request_without_a_server_error() {
    let Some(schemathesis) = schemathesis() else {
        assert!(
            std::env::var("ENGRAM_TEST_PYTHON").is_err(),
            "ENGRAM_TEST_PYTHON is set but its venv has no schemathesis"
        );
        eprintln!("SKIPPED: no venv with schemathesis; run ./scripts/test.sh to set one up");
        return;
    };
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    // Some memory to find, so not every generated call is a 404.
    say(&proxy, "default", "alice", "s", "I'm allergic to peanuts.").await;
    let examples = std::env::var("ENGRAM_SCHEMATHESIS_EXAMPLES").unwrap_or_else(|_| "25".into());
    let schema = proxy.url("/engram/v1/openapi.json");
    // Its example cache goes in a scratch directory, not the checkout.
    let scratch = tempfile::tempdir().unwrap();
    let workdir = scratch.path().to_owned();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(schemathesis)
            .current_dir(workdir)
            .args(["run", &schema])
            .args(["--header", &format!("Authorization: Bearer {ADMIN_TOKEN}")])
            .args(["--checks", "not_a_server_error"])
            .args(["--max-examples", &examples])
            .args(["--seed", "20261123"])
            .args(["--request-timeout", "10"])
            .env("SCHEMATHESIS_TELEMETRY", "false")
            .output()
            .expect("run schemathesis")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // It really ran: every operation of the document was exercised.
    assert!(stdout.contains("passed"), "{stdout}");
    assert!(
        !proxy
            .stderr_lines()
            .iter()
            .any(|line| line.contains("panicked"))
    );
}
