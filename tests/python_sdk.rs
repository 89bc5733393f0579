//! The official `openai` Python SDK pointed at the proxy by base URL only.
//!
//! The README's test command creates a venv with the SDK and sets `ENGRAM_TEST_PYTHON`. Without
//! it, the test uses `python3` if that can import `openai`, and otherwise skips, saying why.

mod common;

use std::process::Command;

use common::*;

#[tokio::test]
async fn the_openai_python_sdk_works_through_the_proxy() {
    let Some(python) = python::python_with_openai() else {
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
