//! `engram-eval locomo` on a small synthetic conversation written for these tests
//! (`tests/data/locomo-synthetic.json`, LoCoMo's shape): the replay protocol as the proxy saw
//! it, and the metrics on cases checked by hand. The development split itself is only read when
//! it is present beside the repository (its licence keeps it out of the repository).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    reason = "tests: a failure should fail loudly; skips are printed"
)]

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::Command;

use engram::app::{Credentials, Engram};
use engram_eval::client::ProxyClient;
use engram_eval::locomo::{EvalOptions, run};
use engram_eval::progress::Progress;
use engram_memory::tokens::{Encoding, count_in};
use engram_ops::admin::AdminAuth;
use engram_ops::config::Config;
use http::Method;
use serde_json::Value;
use tokio::sync::oneshot;

const BIN: &str = env!("CARGO_BIN_EXE_engram-eval");
const ADMIN_TOKEN: &str = "test-admin-token";

fn synthetic() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/locomo-synthetic.json")
}

fn free_address() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// The exchanges the protocol makes of the synthetic conversation: (session, event time, user
/// message, scripted reply), in replay order.
const EXCHANGES: [(&str, &str, &str, &str); 8] = [
    (
        "session_1",
        "2023-05-08T13:56:00Z",
        "Ann: Hi Bob! I adopted a greyhound named Bolt last week.\nAnn: He loves running on the beach.",
        "Bob: Congratulations! How old is he? [shares a photo: a photo of a grey dog on sand]",
    ),
    (
        "session_1",
        "2023-05-08T13:56:00Z",
        "Ann: He is three years old and very calm.",
        "Bob: Lovely, enjoy your walks.",
    ),
    // Session 2 starts with Bob: he is the user there.
    (
        "session_2",
        "2023-06-20T10:05:00Z",
        "Bob: Guess what, I started learning the cello this month.",
        "Ann: That is wonderful! Who teaches you?",
    ),
    (
        "session_2",
        "2023-06-20T10:05:00Z",
        "Bob: My teacher is called Marta, she plays in an orchestra.",
        "",
    ),
    (
        "session_3",
        "2023-07-02T19:30:00Z",
        "Ann: Bolt and I hiked up Mount Tamalpais on Saturday.",
        "Bob: Nice hike! Was it hot?",
    ),
    (
        "session_3",
        "2023-07-02T19:30:00Z",
        "Ann: Very hot, we carried plenty of water.",
        "Bob: Smart.",
    ),
    (
        "session_3",
        "2023-07-02T19:30:00Z",
        "Ann: Next month I am visiting my sister in Lisbon.",
        "Bob: Bring me a pastel de nata!",
    ),
    ("session_3", "2023-07-02T19:30:00Z", "Ann: Deal.", ""),
];

fn chat_tokens(exchanges: &[(&str, &str, &str, &str)]) -> u64 {
    exchanges
        .iter()
        .map(|(_, _, user, reply)| {
            u64::from(count_in(Encoding::Cl100k, user) + count_in(Encoding::Cl100k, reply))
        })
        .sum()
}

fn figure(question: &Value, system: &str, key: &str) -> Value {
    question[system][key].clone()
}

/// A proxy over a fresh embedded store, in front of the harness's scripted upstream at `mock`,
/// served in this process while `checks` runs against its address; stopped after them.
async fn with_proxy<F: Future<Output = ()>>(mock: SocketAddr, checks: impl FnOnce(String) -> F) {
    let data = tempfile::tempdir().unwrap();
    let mut config = Config::default();
    config.server.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.upstream.base_url = format!("http://{mock}/v1");
    config.store.data_dir = data.path().to_path_buf();
    // A debug build on a loaded machine can miss the production deadline.
    config.store.hot_path_deadline_ms = 5000;
    let credentials = Credentials::admin_only(AdminAuth::global(ADMIN_TOKEN));
    let engram = Engram::build(config, credentials).await.unwrap();
    let address = format!("http://{}", engram.local_addr().unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    let serving = engram.run(async move {
        let _ = stopped.await;
    });
    let checking = async move {
        checks(address).await;
        let _ = stop.send(());
    };
    let (served, ()) = tokio::join!(serving, checking);
    served.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_follows_the_protocol_and_metrics_match_hand_checked_figures() {
    let mock = free_address();
    with_proxy(mock, |proxy| replay_and_check(proxy, mock)).await;
}

async fn replay_and_check(proxy: String, mock: SocketAddr) {
    let client = ProxyClient::new(&proxy, ADMIN_TOKEN);
    let out = tempfile::tempdir().unwrap();
    let output = run(EvalOptions {
        data: synthetic(),
        budget: 2048,
        sweep: vec![512],
        out: Some(out.path().to_path_buf()),
        proxy: Some(proxy.clone()),
        mock_listen: mock,
        admin_token: Some(ADMIN_TOKEN.to_owned()),
        config: Config::default(),
        progress: Progress::quiet(),
        trace: true,
    })
    .await
    .unwrap();
    let report = serde_json::to_value(&output.report).unwrap();

    // ---- the protocol, as the proxy recorded it ----
    let protocol = &report["protocol"];
    assert_eq!(protocol["exchanges_sent"], 8, "{protocol}");
    // An external proxy has one budget: the sweep is not measured.
    assert_eq!(protocol["questions_sent"], 4, "category 5 is not asked");
    assert_eq!(protocol["upstream_requests"], 12);
    assert_eq!(protocol["upstream_unscripted"], 0);
    assert_eq!(protocol["replay_prompt_violations"], 0);
    assert_eq!(protocol["raw_turn_mismatches"], 0);
    assert_eq!(protocol["jobs_recorded_by_questions"], 0);
    assert_eq!(report["protocol_holds"], true);
    assert_eq!(report["unresolved_evidence"], 1, "D9:9 names no turn");

    let memory = client
        .admin(Method::GET, "users/syn-1/memory")
        .await
        .unwrap();
    let sessions: Vec<&str> = memory["memory"]["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|session| session["id"].as_str().unwrap())
        .collect();
    // The questions ran in sessions of their own, read-only: nothing of them was recorded.
    assert_eq!(sessions, ["session_1", "session_2", "session_3"]);
    let raw = memory["memory"]["raw_turns"].as_array().unwrap();
    assert_eq!(raw.len(), EXCHANGES.len());
    for (turn, (session, time, user, reply)) in raw.iter().zip(EXCHANGES) {
        assert_eq!(
            sessions[turn["session"].as_u64().unwrap() as usize],
            session
        );
        assert_eq!(turn["event_time"], time);
        assert_eq!(turn["user"], user);
        assert_eq!(turn["assistant"], reply, "the upstream replied verbatim");
    }
    let queue = client.admin(Method::GET, "queue").await.unwrap();
    assert_eq!(queue["recorded"]["queued"], 8, "{queue}");

    // ---- metrics, by hand ----
    let questions = report["questions_detail"].as_array().unwrap();
    assert_eq!(questions.len(), 4);
    let full_tokens = chat_tokens(&EXCHANGES);
    let window_tokens = chat_tokens(&EXCHANGES[2..]);
    for question in questions {
        assert_eq!(figure(question, "full_history", "evidence_recall"), 1.0);
        assert_eq!(figure(question, "full_history", "tokens"), full_tokens);
        assert_eq!(figure(question, "window", "tokens"), window_tokens);
    }
    // The window (the last 6 of 8 exchanges) lost session 1.
    let window: Vec<Value> = questions
        .iter()
        .map(|q| figure(q, "window", "evidence_recall"))
        .collect();
    assert_eq!(window, [0.0, 0.0, 1.0, 1.0]);
    // "Bolt" and "Marta" are in the text; "3" (said as "three") and "June 2023" are not.
    let answers: Vec<Value> = questions
        .iter()
        .map(|q| figure(q, "full_history", "answer_found"))
        .collect();
    assert_eq!(answers, [true, false, false, true]);
    // Session 3 mentions Bolt, so the window finds that answer too.
    assert_eq!(figure(&questions[0], "window", "answer_found"), true);
    assert_eq!(questions[3]["evidence"], serde_json::json!(["D2:3"]));

    let headline = report["headline"].as_array().unwrap();
    let system = |name: &str| {
        headline
            .iter()
            .find(|row| row["system"] == name)
            .unwrap_or_else(|| panic!("no {name} row"))
    };
    let full = &system("full history")["overall"];
    assert_eq!(full["questions"], 4);
    assert_eq!(full["with_evidence"], 4);
    assert_eq!(full["evidence_recall"], 1.0);
    assert_eq!(full["answer_recall"], 0.5);
    assert_eq!(full["tokens"]["median"], full_tokens as f64);
    let window = &system("last 6 exchanges")["overall"];
    assert_eq!(window["evidence_recall"], 0.5);
    assert_eq!(window["answer_recall"], 0.5);
    let by_category: Vec<(u64, u64)> = system("full history")["categories"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["number"].as_u64().unwrap(),
                c["questions"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(by_category, [(1, 1), (2, 1), (4, 2)]);

    // engram: the greyhound question finds its exchange, whole, within the budget.
    let engram = &questions[0]["engram"];
    assert_eq!(engram["evidence_recall"], 1.0, "{engram}");
    assert_eq!(engram["provenance_recall"], 1.0);
    assert_eq!(engram["answer_found"], true);
    let tokens = engram["tokens"].as_u64().unwrap();
    assert!(tokens > 0 && tokens <= 2048, "{tokens}");

    for file in [
        "locomo.md",
        "locomo.json",
        "locomo.svg",
        "locomo-trace.jsonl",
    ] {
        assert!(out.path().join(file).exists(), "{file}");
    }
    assert!(output.markdown.contains("| overall | engram |"));
    assert!(output.svg.starts_with("<svg"));
}

#[test]
fn the_command_writes_the_report_and_sweeps_budgets_in_process() {
    let out = tempfile::tempdir().unwrap();
    let result = Command::new(BIN)
        .args(["locomo", "--data"])
        .arg(synthetic())
        .arg("--out")
        .arg(out.path())
        .args(["--sweep", "512,4096", "--no-progress"])
        .env_remove("RUST_LOG")
        .env_remove("ENGRAM_CONFIG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&result.stdout);
    assert!(
        result.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&result.stderr)
    );
    assert!(
        stdout.contains("syn-1: 3 sessions, 8 exchanges, 4 questions"),
        "{stdout}"
    );
    assert!(stdout.contains("total runtime"), "{stdout}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("locomo.json")).unwrap())
            .unwrap();
    assert_eq!(report["protocol_holds"], true);
    // The default budget first, then the sweep: 3 budgets, 4 questions each, in hybrid
    // retrieval (the default) and again in lexical.
    assert_eq!(report["protocol"]["questions_sent"], 24);
    let budgets_of = |system: &str| -> Vec<u64> {
        report["sweep"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|point| point["system"] == system)
            .map(|point| point["budget"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(budgets_of("engram"), [512, 2048, 4096]);
    assert_eq!(budgets_of("engram, lexical"), [512, 2048, 4096]);
    let headline: Vec<&str> = report["headline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row["system"].as_str().unwrap())
        .collect();
    assert_eq!(headline[..2], ["engram", "engram, lexical"]);
    let svg = std::fs::read_to_string(out.path().join("locomo.svg")).unwrap();
    assert!(svg.contains("evidence recall") && svg.trim_end().ends_with("</svg>"));
}

/// The first conversation of the development split, when the data is beside the repository.
#[test]
fn development_conversation_beats_the_window() {
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/locomo/locomo-dev.json");
    let Ok(text) = std::fs::read_to_string(&data) else {
        println!(
            "skipped: the LoCoMo development split is not at {} (it stays out of the repository)",
            data.display()
        );
        return;
    };
    let all: Vec<Value> = serde_json::from_str(&text).unwrap();
    let out = tempfile::tempdir().unwrap();
    // A temporary copy of one conversation, never written into the repository.
    let one = out.path().join("one.json");
    std::fs::write(&one, serde_json::to_string(&all[..1]).unwrap()).unwrap();
    let result = Command::new(BIN)
        .args(["locomo", "--data"])
        .arg(&one)
        .arg("--out")
        .arg(out.path())
        .args(["--sweep", "2048", "--no-progress"])
        .env_remove("RUST_LOG")
        .env_remove("ENGRAM_CONFIG")
        .output()
        .unwrap();
    assert!(
        result.status.success(),
        "{}",
        String::from_utf8_lossy(&result.stderr)
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("locomo.json")).unwrap())
            .unwrap();
    let overall = |system: &str| {
        report["headline"]
            .as_array()
            .unwrap()
            .iter()
            .find(|row| row["system"] == system)
            .unwrap()["overall"]
            .clone()
    };
    assert_eq!(overall("full history")["evidence_recall"], 1.0);
    let engram = overall("engram")["evidence_recall"].as_f64().unwrap();
    let window = overall("last 6 exchanges")["evidence_recall"]
        .as_f64()
        .unwrap();
    assert!(engram > window + 0.3, "engram {engram}, window {window}");
    assert!(overall("engram")["tokens"]["p95"].as_f64().unwrap() <= 2048.0);
}
