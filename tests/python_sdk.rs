//! The official `openai` Python SDK pointed at the proxy by base URL only.
//!
//! The README's test command creates a venv with the SDK and sets `ENGRAM_TEST_PYTHON`. Without
//! it, the test uses `python3` if that can import `openai`, and otherwise skips, saying why.

mod common;

use std::process::Command;

use common::*;

fn python_with_openai() -> Option<String> {
    let candidates = [
        std::env::var("ENGRAM_TEST_PYTHON").ok(),
        Some("python3".to_owned()),
    ];
    candidates.into_iter().flatten().find(|python| {
        Command::new(python)
            .args(["-c", "import openai"])
            .output()
            .is_ok_and(|output| output.status.success())
    })
}

#[tokio::test]
async fn the_openai_python_sdk_works_through_the_proxy() {
    let Some(python) = python_with_openai() else {
        assert!(
            std::env::var("ENGRAM_TEST_PYTHON").is_err(),
            "ENGRAM_TEST_PYTHON is set but cannot import openai"
        );
        eprintln!(
            "SKIPPED: no Python with the `openai` package; run ./scripts/test.sh to set one up"
        );
        return;
    };
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/openai_sdk_e2e.py"
    );
    let output = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .arg(proxy.url("/v1"))
            .arg(upstream.url("/v1"))
            .output()
            .expect("run python")
    })
    .await
    .unwrap();
    assert!(
        output.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
