//! The Python with the official `openai` SDK that the SDK-driven tests run.

use std::process::Command;

/// `ENGRAM_TEST_PYTHON` (set by the README's test command, which makes a venv with the SDK), or
/// `python3` if it can import `openai`. `None` means the caller skips, saying why; but when
/// `ENGRAM_TEST_PYTHON` is set and cannot import the SDK, that is a broken setup and panics.
pub fn python_with_openai() -> Option<String> {
    let candidates = [
        std::env::var("ENGRAM_TEST_PYTHON").ok(),
        Some("python3".to_owned()),
    ];
    let found = candidates.into_iter().flatten().find(|python| {
        Command::new(python)
            .args(["-c", "import openai"])
            .output()
            .is_ok_and(|output| output.status.success())
    });
    if found.is_none() {
        assert!(
            std::env::var("ENGRAM_TEST_PYTHON").is_err(),
            "ENGRAM_TEST_PYTHON is set but cannot import openai"
        );
        println!(
            "SKIPPED: no Python with the `openai` package; run ./scripts/test.sh to set one up"
        );
    }
    found
}
