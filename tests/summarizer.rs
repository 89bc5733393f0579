//! The LLM summarizer against the in-process mock upstream: the prompt contract, each fallback,
//! the grounding check, the rate limit and fence stripping.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a failure should fail the test loudly"
)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use engram_memory::FactEdit;
use engram_mock::{MockOptions, MockServer};
use engram_proxy::summarizer::{Summarizer, SummarizerConfig, SummaryFailure, SummarySource};
use serde_json::{Value, json};
use tokio_util::task::TaskTracker;

const USER: &str = "I just moved to Berlin last month and I work as a nurse now.";
const ASSISTANT: &str = "Congratulations on the move! Night shifts in a new city can be hard.";

struct Mock {
    base_url: String,
    record: PathBuf,
    _dir: tempfile::TempDir,
    _tasks: TaskTracker,
}

impl Mock {
    async fn start(reply: Option<&str>, latency: Duration) -> Mock {
        let dir = tempfile::tempdir().unwrap();
        let record = dir.path().join("requests.jsonl");
        let server = MockServer::bind(MockOptions {
            reply: reply.map(str::to_owned),
            latency,
            record: Some(record.clone()),
            ..MockOptions::default()
        })
        .await
        .unwrap();
        let address = server.local_addr().unwrap();
        let tasks = TaskTracker::new();
        tasks.spawn(server.run());
        Mock {
            base_url: format!("http://{address}/v1"),
            record,
            _dir: dir,
            _tasks: tasks,
        }
    }

    fn config(&self) -> SummarizerConfig {
        SummarizerConfig {
            base_url: Some(self.base_url.clone()),
            ..SummarizerConfig::default()
        }
    }

    fn summarizer(&self) -> Summarizer {
        Summarizer::new(&self.config(), Some("sk-test".into())).unwrap()
    }

    /// The chat requests the mock received, in order.
    fn requests(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.record)
            .unwrap_or_default()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }
}

fn reply(add: &[&str], update: &[&str]) -> String {
    json!({
        "user_summary": "Moved to Berlin last month; works as a nurse.",
        "assistant_summary": "Congratulated the move, noted night shifts are hard.",
        "add": add,
        "update": update,
        "remove": [],
    })
    .to_string()
}

#[tokio::test]
async fn valid_json_is_used_as_is() {
    let mock = Mock::start(
        Some(&reply(&["job: nurse"], &["lives in: Berlin"])),
        Duration::ZERO,
    )
    .await;
    let summarizer = mock.summarizer();
    let summary = summarizer.extract(USER, ASSISTANT).await;
    assert_eq!(summary.source, SummarySource::Llm);
    assert!(!summary.retry_later);
    assert!(summary.ungrounded.is_empty());
    let diff = &summary.extraction.diff;
    assert_eq!(diff.add, [FactEdit::new("job: nurse")]);
    assert_eq!(diff.update, [FactEdit::new("lives in: Berlin")]);
    assert_eq!(
        summary.extraction.user_summary,
        "Moved to Berlin last month; works as a nurse."
    );

    let requests = mock.requests();
    assert_eq!(requests.len(), 1);
    let request = &requests[0];
    assert_eq!(request["model"], "gpt-4o-mini");
    assert_eq!(request["temperature"], 0);
    assert_eq!(request["response_format"]["type"], "json_object");
    assert_eq!(request["messages"][0]["role"], "system");
    let exchange: Value =
        serde_json::from_str(request["messages"][1]["content"].as_str().unwrap()).unwrap();
    assert_eq!(exchange["user_message"], USER);
    assert_eq!(exchange["assistant_reply"], ASSISTANT);

    // The worker's background retry path: one model extraction, no fallback.
    let retried = summarizer.extract_llm(USER, ASSISTANT).await.unwrap();
    assert_eq!(retried.source, SummarySource::Llm);
    assert_eq!(retried.extraction, summary.extraction);
}

#[tokio::test]
async fn a_fenced_json_reply_is_accepted() {
    let fenced = format!("```json\n{}\n```", reply(&["job: nurse"], &[]));
    let mock = Mock::start(Some(&fenced), Duration::ZERO).await;
    let summary = mock.summarizer().extract(USER, ASSISTANT).await;
    assert_eq!(summary.source, SummarySource::Llm);
    assert_eq!(summary.extraction.diff.add, [FactEdit::new("job: nurse")]);
}

#[tokio::test]
async fn invalid_json_is_retried_once_then_falls_back() {
    let mock = Mock::start(
        Some("Sure! The user moved to Berlin and is a nurse."),
        Duration::ZERO,
    )
    .await;
    let summarizer = mock.summarizer();
    let summary = summarizer.extract(USER, ASSISTANT).await;
    assert_eq!(
        summary.source,
        SummarySource::Fallback {
            reason: SummaryFailure::InvalidJson
        }
    );
    // The same reply would come back: not worth a background retry.
    assert!(!summary.retry_later);
    assert_eq!(mock.requests().len(), 2, "one retry, then the heuristic");
    // The heuristic extractor's result, from the user's own words.
    let texts: Vec<&str> = summary
        .extraction
        .diff
        .update
        .iter()
        .map(|edit| edit.text.as_str())
        .collect();
    assert!(texts.contains(&"lives in: Berlin"), "{texts:?}");
    assert!(!summary.extraction.user_summary.is_empty());

    assert_eq!(
        summarizer.extract_llm(USER, ASSISTANT).await,
        Err(SummaryFailure::InvalidJson)
    );
    assert_eq!(mock.requests().len(), 4);
}

#[tokio::test]
async fn a_wrong_shape_counts_as_invalid_json() {
    let mock = Mock::start(Some(r#"{"add": "lives in: Berlin"}"#), Duration::ZERO).await;
    let summary = mock.summarizer().extract(USER, ASSISTANT).await;
    assert_eq!(
        summary.source,
        SummarySource::Fallback {
            reason: SummaryFailure::InvalidJson
        }
    );
    assert_eq!(mock.requests().len(), 2);
}

#[tokio::test]
async fn hallucinated_entries_are_dropped_by_grounding() {
    let mock = Mock::start(
        Some(&reply(
            &["job: nurse", "pet: dragon"],
            &["lives in: Berlin", "owns: a yacht in Monaco"],
        )),
        Duration::ZERO,
    )
    .await;
    let summary = mock.summarizer().extract(USER, ASSISTANT).await;
    assert_eq!(summary.source, SummarySource::Llm);
    assert_eq!(summary.extraction.diff.add, [FactEdit::new("job: nurse")]);
    assert_eq!(
        summary.extraction.diff.update,
        [FactEdit::new("lives in: Berlin")]
    );
    assert_eq!(
        summary.ungrounded,
        ["pet: dragon", "owns: a yacht in Monaco"]
    );
}

#[tokio::test]
async fn a_timeout_falls_back_now_and_asks_for_a_retry() {
    let mock = Mock::start(Some(&reply(&["job: nurse"], &[])), Duration::from_secs(1)).await;
    let config = SummarizerConfig {
        timeout_ms: 200,
        ..mock.config()
    };
    let summarizer = Summarizer::new(&config, None).unwrap();
    let started = Instant::now();
    let summary = summarizer.extract(USER, ASSISTANT).await;
    let elapsed = started.elapsed();
    assert_eq!(
        summary.source,
        SummarySource::Fallback {
            reason: SummaryFailure::Timeout
        }
    );
    assert!(summary.retry_later);
    assert!(
        elapsed >= Duration::from_millis(190) && elapsed < Duration::from_millis(700),
        "{elapsed:?}"
    );
    assert!(!summary.extraction.diff.is_empty(), "the heuristic result");
}

#[tokio::test]
async fn an_unreachable_summarizer_falls_back_with_a_retry() {
    // Port 9 (discard) on loopback is closed on test machines.
    let config = SummarizerConfig {
        base_url: Some("http://127.0.0.1:9/v1".into()),
        ..SummarizerConfig::default()
    };
    let summary = Summarizer::new(&config, None)
        .unwrap()
        .extract(USER, ASSISTANT)
        .await;
    assert_eq!(
        summary.source,
        SummarySource::Fallback {
            reason: SummaryFailure::Transport
        }
    );
    assert!(summary.retry_later);
}

#[tokio::test]
async fn not_configured_is_the_heuristic() {
    let summarizer = Summarizer::from_config(&SummarizerConfig::default()).unwrap();
    let summary = summarizer.extract(USER, ASSISTANT).await;
    assert_eq!(summary.source, SummarySource::Heuristic);
    assert!(!summary.retry_later);
    assert!(!summary.extraction.diff.is_empty());
}

#[tokio::test]
async fn its_own_rate_limit_falls_back_without_a_request() {
    let mock = Mock::start(Some(&reply(&["job: nurse"], &[])), Duration::ZERO).await;
    let config = SummarizerConfig {
        requests_per_minute: 1,
        ..mock.config()
    };
    let summarizer = Summarizer::new(&config, None).unwrap();
    let first = summarizer.extract(USER, ASSISTANT).await;
    assert_eq!(first.source, SummarySource::Llm);
    let second = summarizer.extract(USER, ASSISTANT).await;
    assert_eq!(
        second.source,
        SummarySource::Fallback {
            reason: SummaryFailure::RateLimited
        }
    );
    assert!(second.retry_later);
    assert_eq!(mock.requests().len(), 1);
}

#[tokio::test]
async fn engram_fences_never_reach_the_summarizer() {
    let mock = Mock::start(Some(&reply(&[], &["lives in: Berlin"])), Duration::ZERO).await;
    let user = "<engram-memory kind=\"core\">\n- launch code: 0000-SECRET\n</engram-memory>\n\n\
                I just moved to Berlin last month.";
    let assistant = "Welcome to Berlin! <ENGRAM-MEMORY kind=\"recall\">echoed memory \
                     text</engram-memory> Enjoy.";
    let summary = mock.summarizer().extract(user, assistant).await;
    assert_eq!(summary.source, SummarySource::Llm);

    let requests = mock.requests();
    let body = requests[0].to_string().to_lowercase();
    for leaked in [
        "engram-memory",
        "launch code",
        "0000-secret",
        "echoed memory",
    ] {
        assert!(!body.contains(leaked), "{leaked} reached the summarizer");
    }
    let exchange: Value =
        serde_json::from_str(requests[0]["messages"][1]["content"].as_str().unwrap()).unwrap();
    assert_eq!(
        exchange["user_message"],
        "I just moved to Berlin last month."
    );
    assert_eq!(exchange["assistant_reply"], "Welcome to Berlin! Enjoy.");
}

#[tokio::test]
async fn long_exchanges_are_capped() {
    let mock = Mock::start(Some(&reply(&[], &[])), Duration::ZERO).await;
    let config = SummarizerConfig {
        max_input_chars: 1_000,
        ..mock.config()
    };
    let long = "All work and no play makes Jack a dull boy. ".repeat(200);
    let summarizer = Summarizer::new(&config, None).unwrap();
    summarizer.extract(USER, &long).await;
    let requests = mock.requests();
    let exchange: Value =
        serde_json::from_str(requests[0]["messages"][1]["content"].as_str().unwrap()).unwrap();
    let user = exchange["user_message"].as_str().unwrap();
    let assistant = exchange["assistant_reply"].as_str().unwrap();
    assert_eq!(user, USER);
    assert_eq!(user.chars().count() + assistant.chars().count(), 1_000);
}
