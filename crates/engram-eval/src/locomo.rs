//! `engram-eval locomo`: replays LoCoMo conversations through the proxy, asks their questions
//! read-only, and scores the prompts the upstream received against the baselines.
//!
//! The replay protocol, fixed so figures compare across versions:
//! - user id = the conversation's `sample_id`; session id = `session_<n>`; each session's
//!   exchanges (see [`super::dataset::exchanges`]) are sent in order, one request each, with
//!   `x-engram-event-time` from `session_<n>_date_time`; the client is stateless (only the new
//!   user message); the scripted upstream answers with the exchange's assistant run verbatim;
//! - after the last session, once the worker has applied every recorded exchange, each question
//!   of categories 1–4 is sent as the only user message, under the same user, in a session of
//!   its own (`probe-<n>`), with `x-engram-mode: read-only`; the upstream records the prompt and
//!   the harness reads the turn's explanation from the management API;
//! - memory does not depend on the budget (only composition does), so the replay is applied once
//!   and the questions are asked again for every budget of the sweep, each on a proxy started
//!   with that budget over the same store.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::Method;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

use super::baselines::{BaselinePrompt, ConversationBaselines};
use super::client::ProxyClient;
use super::dataset::{self, Category, Conversation, TurnPos};
use super::metrics::{Breakdown, QuestionScore, normalise, score};
use super::progress::Progress;
use super::report::{self, Report};
use super::upstream::{EXCHANGE_HEADER, ScriptedUpstream};
use engram::app::{Credentials, Engram};
use engram::error::{Error, Result};
use engram_memory::config::RetrievalMode;
use engram_memory::openai::ChatMessage;
use engram_memory::tokens::{Encoding, count_in};
use engram_ops::config::{Config, StoreBackend};
use engram_proxy::pipeline::identity::{
    EVENT_TIME_HEADER, MODE_HEADER, SESSION_HEADER, USER_HEADER,
};

/// The model named in every request: not an o200k model, so engram counts in cl100k, the
/// encoding the metrics use.
pub const MODEL: &str = "locomo-eval";
/// The budgets of the chart.
pub const SWEEP: [u32; 4] = [512, 1024, 2048, 4096];
/// The reply the scripted upstream gives a question.
const PROBE_REPLY: &str = "(evaluation probe)";

pub struct EvalOptions {
    pub data: PathBuf,
    /// The budget of the headline table.
    pub budget: u32,
    /// Budgets of the chart (the headline budget is always included).
    pub sweep: Vec<u32>,
    pub out: Option<PathBuf>,
    /// A running proxy to use instead of an in-process one; its upstream must be
    /// `mock_listen`, and only its own budget can be measured.
    pub proxy: Option<String>,
    pub mock_listen: SocketAddr,
    /// The management API token of an external proxy.
    pub admin_token: Option<String>,
    /// The in-process proxy's configuration (listen address, upstream, store and budget are
    /// set by the harness).
    pub config: Config,
    pub progress: Progress,
    /// Also write `locomo-trace.jsonl`: per question of the headline budget, the prompt the
    /// upstream received and the turn's explanation (for finding what loses evidence).
    pub trace: bool,
}

/// One system's figures for one question.
#[derive(Debug, Clone, Serialize)]
pub struct SystemScore {
    #[serde(flatten)]
    pub score: QuestionScore,
    /// Evidence turns not found verbatim, and where engram lost them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub missed: Vec<Missed>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Missed {
    pub dia_id: String,
    pub why: Loss,
}

/// Where engram lost an evidence turn, from the probe's explanation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Loss {
    /// The turn's exchange was injected, but clipped to its first words.
    Clipped,
    /// Only a summary, fact or episode built from the exchange was injected.
    Summarised,
    /// Retrieved and ranked, but it did not fit the budget.
    NoRoom,
    /// Not among the retrieved candidates.
    NotRetrieved,
    /// Injected whole, yet not found verbatim (a text mismatch; should not happen).
    Mismatch,
    /// The baselines: not selected.
    NotSelected,
}

#[derive(Debug, Clone, Serialize)]
pub struct QuestionRecord {
    pub conversation: String,
    /// Position among the conversation's questions (all categories).
    pub index: usize,
    pub category: Category,
    pub evidence: Vec<String>,
    pub engram: SystemScore,
    pub full_history: SystemScore,
    pub window: SystemScore,
    pub bm25: SystemScore,
}

/// Raw turn sequence number → (session index, exchange index).
type SeqMap = HashMap<u64, (usize, usize)>;

/// How a conversation's exchanges map to engram's turns: their turn ids (per session, per
/// exchange) and raw turn sequence numbers.
struct Replayed {
    turn_ids: Vec<Vec<String>>,
    seq_map: Arc<SeqMap>,
}

/// What one conversation's replay did.
struct Ingested {
    /// Per session, per exchange: the engram turn id the proxy gave it.
    turn_ids: Vec<Vec<String>>,
    /// Replayed prompts whose last message was not the exchange's user message.
    protocol_violations: usize,
    seconds: f64,
}

/// What engram injected for one question at one budget.
struct Probe {
    score: QuestionScore,
    missed: Vec<Missed>,
    degraded: bool,
    trace: Option<Value>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ProtocolCheck {
    pub exchanges_sent: usize,
    pub questions_sent: usize,
    /// Upstream requests the scripted upstream received, and those that named no script.
    pub upstream_requests: u64,
    pub upstream_unscripted: u64,
    /// Replayed prompts whose last message was not the exchange's user message alone.
    pub replay_prompt_violations: usize,
    /// Raw turns in the users' memory after the replay, and after every question was asked.
    pub raw_turns_after_replay: usize,
    pub raw_turns_after_questions: usize,
    /// Raw turns whose session or event time does not match the exchange they record.
    pub raw_turn_mismatches: usize,
    /// Jobs the recorder queued during the questions (read-only: must be 0).
    pub jobs_recorded_by_questions: u64,
    /// Questions answered without memory because the store was slow or failing.
    pub degraded_questions: usize,
}

impl ProtocolCheck {
    pub fn holds(&self) -> bool {
        self.upstream_unscripted == 0
            && self.replay_prompt_violations == 0
            && self.raw_turns_after_replay == self.exchanges_sent
            && self.raw_turns_after_questions == self.raw_turns_after_replay
            && self.raw_turn_mismatches == 0
            && self.jobs_recorded_by_questions == 0
            && self.upstream_requests == (self.exchanges_sent + self.questions_sent) as u64
    }
}

/// The run's results, and the report files' contents.
pub struct EvalOutput {
    pub report: Report,
    pub markdown: String,
    pub svg: String,
    /// Where the files were written.
    pub written: Vec<PathBuf>,
}

/// An in-process proxy over a temporary embedded store.
struct LocalProxy {
    address: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<()>>,
}

impl LocalProxy {
    async fn start(config: &Config, token: &str, tasks: &TaskTracker) -> Result<LocalProxy> {
        // The previous proxy on the same store may still be letting go of the file.
        let mut attempts = 0;
        let engram = loop {
            match Engram::build(
                config.clone(),
                Credentials::admin_only(engram_ops::admin::AdminAuth::global(token)),
            )
            .await
            {
                Ok(engram) => break engram,
                Err(Error::Config { path, .. }) if path == "store.data_dir" && attempts < 100 => {
                    attempts += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(error) => return Err(error),
            }
        };
        let address = engram.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tasks.spawn(engram.run(async move {
            let _ = stopped.await;
        }));
        Ok(LocalProxy {
            address,
            stop: Some(stop),
            task,
        })
    }

    async fn stop(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task)
            .await
            .map_err(|error| Error::Internal(format!("the proxy task failed: {error}")))?
    }
}

/// A temporary directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<TempDir> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_nanos());
        let path =
            std::env::temp_dir().join(format!("engram-eval-{}-{nanos:x}", std::process::id()));
        std::fs::create_dir_all(&path)?;
        Ok(TempDir(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn random_token() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos());
    format!(
        "eval-{:x}",
        engram_memory::text::fnv1a(0, format!("{nanos}:{}", std::process::id()).as_bytes())
    )
}

/// The budgets to measure, the headline one first.
fn budgets(options: &EvalOptions) -> Vec<u32> {
    let mut budgets = vec![options.budget];
    if options.proxy.is_none() {
        for budget in &options.sweep {
            if !budgets.contains(budget) {
                budgets.push(*budget);
            }
        }
    }
    budgets
}

pub async fn run(options: EvalOptions) -> Result<EvalOutput> {
    let started = Instant::now();
    let conversations: Vec<Arc<Conversation>> = dataset::load(&options.data)?
        .into_iter()
        .map(Arc::new)
        .collect();
    if conversations.is_empty() {
        return Err(Error::Internal("the data holds no conversation".into()));
    }
    let budgets = budgets(&options);
    let mode = options.config.memory.retrieval.mode;
    // Hybrid is compared with lexical retrieval in the same run, over the same replay (the
    // mode only changes how questions are answered). A running proxy (`--proxy`) has one.
    let modes: Vec<RetrievalMode> = if mode == RetrievalMode::Hybrid && options.proxy.is_none() {
        vec![mode, RetrievalMode::Lexical]
    } else {
        vec![mode]
    };
    let rounds: Vec<(RetrievalMode, u32)> = modes
        .iter()
        .flat_map(|mode| budgets.iter().map(move |budget| (*mode, *budget)))
        .collect();
    let tracker = TaskTracker::new();
    let upstream = Arc::new(ScriptedUpstream::start(options.mock_listen).await?);
    let store_dir = TempDir::new()?;
    let mut config = options.config.clone();
    config.server.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.upstream.base_url = upstream.base_url();
    config.upstream.api_key_env = None;
    config.store.backend = StoreBackend::Embedded;
    config.store.data_dir = store_dir.0.clone();
    // The eval measures what memory holds, not latency: a slow read on a busy machine must not
    // send a question upstream without memory.
    config.store.hot_path_deadline_ms = config.store.hot_path_deadline_ms.max(10_000);
    config.worker.enabled = true;
    config.worker.idle_priority = false;
    config.memory.budget_tokens = options.budget;

    let (client, mut local) = match &options.proxy {
        Some(url) => {
            let token = options.admin_token.clone().ok_or_else(|| {
                Error::Internal(
                    "--proxy needs the proxy's management token in ENGRAM_ADMIN_TOKEN".into(),
                )
            })?;
            (ProxyClient::new(url, &token), None)
        }
        None => {
            let token = random_token();
            let proxy = LocalProxy::start(&config, &token, &tracker).await?;
            (
                ProxyClient::new(&format!("http://{}", proxy.address), &token),
                Some((proxy, token)),
            )
        }
    };

    let exchanges: usize = conversations.iter().map(|c| c.exchange_count()).sum();
    let questions: usize = conversations
        .iter()
        .map(|c| c.evaluated_questions().count())
        .sum();
    let progress = &options.progress;
    progress.start((exchanges + questions * rounds.len()) as u64);
    progress.line(&format!(
        "replaying {} conversations ({exchanges} exchanges, {questions} questions) at budgets {}",
        conversations.len(),
        budgets
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    ));

    // ---- replay ----
    let before = client.queue().await?;
    let applied_before = before["worker"]["applied"].as_u64().unwrap_or(0)
        + before["worker"]["duplicates"].as_u64().unwrap_or(0);
    if options.proxy.is_some() {
        for conversation in &conversations {
            let path = format!("users/{}", conversation.sample_id);
            // A user never seen is fine; any other failure shows up in the replay.
            let _ = client.admin(Method::DELETE, &path).await;
        }
    }
    let ingest_started = Instant::now();
    let mut tasks = Vec::new();
    for conversation in &conversations {
        let conversation = Arc::clone(conversation);
        let client = client.clone();
        let upstream = Arc::clone(&upstream);
        let progress = progress.clone();
        tasks.push(
            tracker
                .spawn(async move { ingest(&conversation, &client, &upstream, &progress).await }),
        );
    }
    let mut ingested = Vec::new();
    for task in tasks {
        ingested.push(
            task.await
                .map_err(|error| Error::Internal(format!("a replay task failed: {error}")))??,
        );
    }
    client
        .wait_applied(
            applied_before + exchanges as u64,
            Duration::from_secs(60 + exchanges as u64 / 10),
        )
        .await?;
    let ingest_seconds = ingest_started.elapsed().as_secs_f64();

    let mut protocol = ProtocolCheck {
        exchanges_sent: exchanges,
        ..ProtocolCheck::default()
    };
    let mut seq_maps = Vec::new();
    for (conversation, ingested) in conversations.iter().zip(&ingested) {
        protocol.replay_prompt_violations += ingested.protocol_violations;
        let export = client
            .admin(
                Method::GET,
                &format!("users/{}/memory", conversation.sample_id),
            )
            .await?;
        let (turns, mismatches, seq_map) = check_export(conversation, ingested, &export);
        protocol.raw_turns_after_replay += turns;
        protocol.raw_turn_mismatches += mismatches;
        seq_maps.push(seq_map);
    }

    // ---- questions, per budget ----
    let probe_started = Instant::now();
    let mut per_budget: Vec<(RetrievalMode, u32, Vec<Vec<Probe>>)> = Vec::new();
    let mut conversation_seconds = vec![0.0f64; conversations.len()];
    for (round, (round_mode, budget)) in rounds.iter().copied().enumerate() {
        let client = if round == 0 {
            client.clone()
        } else {
            // Only the in-process proxy reaches here (an external one has one budget).
            let Some((proxy, token)) = local.take() else {
                break;
            };
            proxy.stop().await?;
            config.memory.budget_tokens = budget;
            config.memory.retrieval.mode = round_mode;
            let proxy = LocalProxy::start(&config, &token, &tracker).await?;
            let client = ProxyClient::new(&format!("http://{}", proxy.address), &token);
            local = Some((proxy, token));
            client
        };
        let queued_before = queued(&client.queue().await?);
        let mut tasks = Vec::new();
        for (index, conversation) in conversations.iter().enumerate() {
            let conversation = Arc::clone(conversation);
            let client = client.clone();
            let upstream = Arc::clone(&upstream);
            let progress = progress.clone();
            let replayed = Replayed {
                turn_ids: ingested[index].turn_ids.clone(),
                seq_map: Arc::clone(&seq_maps[index]),
            };
            let trace = options.trace && round == 0;
            tasks.push(tracker.spawn(async move {
                let started = Instant::now();
                let probes = ask(
                    &conversation,
                    budget,
                    &client,
                    &upstream,
                    &replayed,
                    &progress,
                    trace,
                )
                .await?;
                Ok::<_, Error>((probes, started.elapsed().as_secs_f64()))
            }));
        }
        let mut probes = Vec::new();
        for (index, task) in tasks.into_iter().enumerate() {
            let (conversation_probes, seconds) = task
                .await
                .map_err(|error| Error::Internal(format!("a question task failed: {error}")))??;
            if round == 0 {
                conversation_seconds[index] = ingested[index].seconds + seconds;
                let conversation = &conversations[index];
                let scores: Vec<QuestionScore> = conversation_probes
                    .iter()
                    .map(|probe| probe.score)
                    .collect();
                let summary = Breakdown::of(&scores).overall;
                progress.line(&format!(
                    "{}: {} sessions, {} exchanges, {} questions; engram at {budget}: evidence \
                     recall {:.3}, answer recall {:.3}, median {:.0} tokens ({:.1} s)",
                    conversation.sample_id,
                    conversation.sessions.len(),
                    conversation.exchange_count(),
                    scores.len(),
                    summary.evidence_recall,
                    summary.answer_recall,
                    summary.tokens.median,
                    conversation_seconds[index],
                ));
            }
            probes.push(conversation_probes);
        }
        protocol.questions_sent += probes.iter().map(Vec::len).sum::<usize>();
        protocol.degraded_questions += probes.iter().flatten().filter(|p| p.degraded).count();
        per_budget.push((round_mode, budget, probes));
        // Read-only: this round's questions queued nothing and left nothing in flight.
        let queue = client.queue().await?;
        protocol.jobs_recorded_by_questions += queued(&queue).saturating_sub(queued_before)
            + queue["recorded"]["in_flight"].as_u64().unwrap_or(0);
    }
    let probe_seconds = probe_started.elapsed().as_secs_f64();

    // ---- read-only check: the raw log is what the replay left ----
    for conversation in &conversations {
        let export = client_for(&local, &client)
            .admin(
                Method::GET,
                &format!("users/{}/memory", conversation.sample_id),
            )
            .await?;
        protocol.raw_turns_after_questions += raw_turns(&export).len();
    }
    (protocol.upstream_requests, protocol.upstream_unscripted) = upstream.counts();
    if let Some((proxy, _)) = local.take() {
        proxy.stop().await?;
    }
    progress.finish();

    // ---- baselines and the report ----
    let baselines: Vec<ConversationBaselines> = conversations
        .iter()
        .map(|conversation| ConversationBaselines::new(conversation))
        .collect();
    let probes_of = |wanted: RetrievalMode| -> report::EngramProbes {
        per_budget
            .iter()
            .filter(|(mode, _, _)| *mode == wanted)
            .map(|(_, budget, probes)| {
                (
                    *budget,
                    probes
                        .iter()
                        .map(|probes| {
                            probes
                                .iter()
                                .map(|probe| (probe.score, probe.missed.clone()))
                                .collect()
                        })
                        .collect(),
                )
            })
            .collect()
    };
    let lexical = if mode == RetrievalMode::Lexical {
        Vec::new()
    } else {
        probes_of(RetrievalMode::Lexical)
    };
    let report = report::build(
        &options,
        &conversations,
        &baselines,
        report::EngramRuns {
            configured: &probes_of(mode),
            lexical: &lexical,
        },
        &conversation_seconds,
        protocol,
        report::Timing {
            total_seconds: started.elapsed().as_secs_f64(),
            replay_seconds: ingest_seconds,
            questions_seconds: probe_seconds,
        },
    );
    let markdown = report::markdown(&report);
    let svg = super::chart::svg(&report);
    let mut written = Vec::new();
    if let Some(out) = &options.out {
        written = write_outputs(out, &report, &markdown, &svg)?;
        if options.trace {
            let mut lines = String::new();
            for probe in per_budget
                .iter()
                .take(1)
                .flat_map(|(_, _, probes)| probes.iter().flatten())
            {
                if let Some(trace) = &probe.trace {
                    lines.push_str(&trace.to_string());
                    lines.push('\n');
                }
            }
            let path = out.join("locomo-trace.jsonl");
            std::fs::write(&path, lines)?;
            written.push(path);
        }
    }
    Ok(EvalOutput {
        report,
        markdown,
        svg,
        written,
    })
}

/// Jobs the proxy's recorder has queued since it started.
fn queued(queue: &Value) -> u64 {
    queue["recorded"]["queued"].as_u64().unwrap_or(0)
}

fn client_for(local: &Option<(LocalProxy, String)>, fallback: &ProxyClient) -> ProxyClient {
    match local {
        Some((proxy, token)) => ProxyClient::new(&format!("http://{}", proxy.address), token),
        None => fallback.clone(),
    }
}

fn write_outputs(out: &Path, report: &Report, markdown: &str, svg: &str) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out)?;
    let json = serde_json::to_string_pretty(report)
        .map_err(|error| Error::Internal(format!("serialising the report: {error}")))?;
    let files = [
        (out.join("locomo.md"), markdown.to_owned()),
        (out.join("locomo.json"), json),
        (out.join("locomo.svg"), svg.to_owned()),
    ];
    let mut written = Vec::new();
    for (path, text) in files {
        std::fs::write(&path, text)?;
        written.push(path);
    }
    Ok(written)
}

/// Replays one conversation, session by session, exchange by exchange.
async fn ingest(
    conversation: &Conversation,
    client: &ProxyClient,
    upstream: &ScriptedUpstream,
    progress: &Progress,
) -> Result<Ingested> {
    let started = Instant::now();
    let mut turn_ids = Vec::new();
    let mut violations = 0;
    let mut last_job: Option<String> = None;
    for session in &conversation.sessions {
        let mut ids = Vec::new();
        for (index, exchange) in session.exchanges.iter().enumerate() {
            let key = format!("{}/{}/{index}", conversation.sample_id, session.id);
            upstream.script(&key, &exchange.assistant);
            let reply = client
                .chat(
                    MODEL,
                    &exchange.user,
                    &[
                        (USER_HEADER, conversation.sample_id.as_str()),
                        (SESSION_HEADER, session.id.as_str()),
                        (EVENT_TIME_HEADER, session.event_time.as_str()),
                        (EXCHANGE_HEADER, key.as_str()),
                    ],
                )
                .await?;
            let turn_id = reply
                .header("x-engram-turn-id")
                .filter(|_| reply.header("x-engram-job-id").is_some())
                .ok_or_else(|| {
                    Error::Internal(format!(
                        "{key}: the proxy did not record the exchange (no x-engram-job-id); \
                         x-engram-memory-reason: {}",
                        reply.header("x-engram-memory-reason").unwrap_or("none")
                    ))
                })?
                .to_owned();
            let prompt = upstream.take_prompt(&key).unwrap_or_default();
            let last_is_exchange = prompt
                .last()
                .is_some_and(|message| message.role == "user" && message.text() == exchange.user);
            if !last_is_exchange {
                violations += 1;
            }
            ids.push(turn_id);
            last_job = reply.header("x-engram-job-id").map(str::to_owned);
            progress.inc(1);
        }
        // The next session starts once this one is applied, so memory records the turns in
        // replay order on every run.
        if let Some(job) = last_job.take() {
            client
                .wait_job(&conversation.sample_id, &job, Duration::from_secs(120))
                .await?;
        }
        turn_ids.push(ids);
    }
    Ok(Ingested {
        turn_ids,
        protocol_violations: violations,
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn raw_turns(export: &Value) -> Vec<Value> {
    export["memory"]["raw_turns"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Checks the user's raw log against the replay: one raw turn per exchange, in replay order,
/// under the exchange's session and event time. Returns the raw turn count, the mismatches, and the map
/// from raw turn sequence number to (session index, exchange index).
fn check_export(
    conversation: &Conversation,
    ingested: &Ingested,
    export: &Value,
) -> (usize, usize, Arc<SeqMap>) {
    let sessions: Vec<String> = export["memory"]["sessions"]
        .as_array()
        .map(|sessions| {
            sessions
                .iter()
                .map(|session| session["id"].as_str().unwrap_or_default().to_owned())
                .collect()
        })
        .unwrap_or_default();
    let mut by_id: HashMap<&str, (usize, usize)> = HashMap::new();
    for (s, ids) in ingested.turn_ids.iter().enumerate() {
        for (e, id) in ids.iter().enumerate() {
            by_id.insert(id.as_str(), (s, e));
        }
    }
    let turns = raw_turns(export);
    let mut mismatches = 0;
    let mut seq_map = HashMap::new();
    let mut previous = None;
    for (seq, turn) in turns.iter().enumerate() {
        let id = turn["id"].as_str().unwrap_or_default();
        let Some(&(s, e)) = by_id.get(id) else {
            mismatches += 1;
            continue;
        };
        // Recorded in replay order.
        if previous.is_some_and(|previous| previous > (s, e)) {
            mismatches += 1;
        }
        previous = Some((s, e));
        let session = &conversation.sessions[s];
        let session_id = turn["session"]
            .as_u64()
            .and_then(|index| sessions.get(index as usize));
        let ok = session_id.is_some_and(|id| *id == session.id)
            && turn["event_time"].as_str() == Some(session.event_time.as_str())
            && normalise(turn["user"].as_str().unwrap_or_default())
                == normalise(&session.exchanges[e].user);
        if !ok {
            mismatches += 1;
        }
        seq_map.insert(seq as u64, (s, e));
    }
    (turns.len(), mismatches, Arc::new(seq_map))
}

/// Asks every question of categories 1–4, read-only, and scores what engram injected.
async fn ask(
    conversation: &Conversation,
    budget: u32,
    client: &ProxyClient,
    upstream: &ScriptedUpstream,
    replayed: &Replayed,
    progress: &Progress,
    trace: bool,
) -> Result<Vec<Probe>> {
    let (turn_ids, seq_map) = (&replayed.turn_ids, &*replayed.seq_map);
    let seq_of: HashMap<(usize, usize), u64> = seq_map
        .iter()
        .map(|(seq, exchange)| (*exchange, *seq))
        .collect();
    let mut exchange_of_turn: HashMap<TurnPos, (usize, usize)> = HashMap::new();
    for (s, session) in conversation.sessions.iter().enumerate() {
        for (e, exchange) in session.exchanges.iter().enumerate() {
            for turn in exchange.user_turns.iter().chain(&exchange.assistant_turns) {
                exchange_of_turn.insert((s, *turn), (s, e));
            }
        }
    }
    let mut probes = Vec::new();
    for (index, question) in conversation.questions.iter().enumerate() {
        if question.category == Category::Adversarial {
            continue;
        }
        let key = format!("{}/q{index}/b{budget}", conversation.sample_id);
        let session = format!("probe-{index}");
        upstream.script(&key, PROBE_REPLY);
        let reply = client
            .chat(
                MODEL,
                &question.question,
                &[
                    (USER_HEADER, conversation.sample_id.as_str()),
                    (SESSION_HEADER, session.as_str()),
                    (MODE_HEADER, "read-only"),
                    (EXCHANGE_HEADER, key.as_str()),
                ],
            )
            .await?;
        if reply.header("x-engram-job-id").is_some() {
            return Err(Error::Internal(format!(
                "{key}: a read-only question was queued for recording"
            )));
        }
        let degraded = reply.header("x-engram-memory") == Some("degraded");
        let explain = match reply.header("x-engram-turn-id") {
            Some(turn) => {
                client
                    .admin(
                        Method::GET,
                        &format!("users/{}/turns/{turn}/explain", conversation.sample_id),
                    )
                    .await?
            }
            None => Value::Null,
        };
        let prompt = upstream.take_prompt(&key).unwrap_or_default();
        let (context, tokens) = prompt_context(&prompt, &question.question);
        let context = normalise(&context);
        let evidence: Vec<String> = question
            .evidence
            .iter()
            .map(|pos| {
                conversation
                    .turn(*pos)
                    .map(|turn| normalise(&turn.evidence_text()))
                    .unwrap_or_default()
            })
            .collect();
        let credits = Credits::from_explain(&explain, seq_map);
        let mut credited = Vec::new();
        let mut missed = Vec::new();
        for (pos, text) in question.evidence.iter().zip(&evidence) {
            let exchange = exchange_of_turn.get(pos).copied();
            let turn_id = exchange.and_then(|(s, e)| turn_ids.get(s)?.get(e));
            credited.push(turn_id.is_some_and(|id| credits.turn_ids.contains(id.as_str())));
            if !text.is_empty() && context.contains(text.as_str()) {
                continue;
            }
            let why = match (turn_id, exchange) {
                (Some(id), Some(exchange)) => credits.loss(id, exchange),
                _ => Loss::NotRetrieved,
            };
            missed.push(Missed {
                dia_id: conversation
                    .turn(*pos)
                    .map(|turn| turn.dia_id.clone())
                    .unwrap_or_default(),
                why,
            });
        }
        let trace = trace.then(|| {
            let evidence: Vec<Value> = question
                .evidence
                .iter()
                .map(|pos| {
                    serde_json::json!({
                        "dia_id": conversation.turn(*pos).map(|turn| turn.dia_id.as_str()),
                        "seq": exchange_of_turn.get(pos).and_then(|exchange| seq_of.get(exchange)),
                    })
                })
                .collect();
            serde_json::json!({
                "conversation": conversation.sample_id,
                "index": index,
                "category": question.category,
                "evidence": evidence,
                "missed": missed,
                "prompt": prompt,
                "explain": explain["explain"],
            })
        });
        probes.push(Probe {
            trace,
            score: score(
                question.category,
                &context,
                &evidence,
                &credited,
                &question.answer,
                tokens,
            ),
            missed,
            degraded,
        });
        progress.inc(1);
    }
    Ok(probes)
}

/// What a probe's explanation credits: the turn ids named by injected items' provenance, how
/// each exchange was injected, and which exchanges were ranked but left out.
struct Credits {
    turn_ids: HashSet<String>,
    whole: HashSet<String>,
    clipped: HashSet<String>,
    left_out: HashSet<(usize, usize)>,
}

impl Credits {
    fn from_explain(explain: &Value, seq_map: &HashMap<u64, (usize, usize)>) -> Credits {
        let mut credits = Credits {
            turn_ids: HashSet::new(),
            whole: HashSet::new(),
            clipped: HashSet::new(),
            left_out: HashSet::new(),
        };
        let explain = &explain["explain"];
        for item in explain["items"].as_array().into_iter().flatten() {
            let ids: Vec<String> = item["provenance"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|id| id.as_str().map(str::to_owned))
                .collect();
            if item["item"]["kind"] == "raw_turn" {
                let target = if item["form"] == "clipped" {
                    &mut credits.clipped
                } else {
                    &mut credits.whole
                };
                target.extend(ids.iter().cloned());
            }
            credits.turn_ids.extend(ids);
        }
        for item in explain["left_out"].as_array().into_iter().flatten() {
            if matches!(item["kind"].as_str(), Some("raw_turn" | "summary"))
                && let Some(exchange) = item["id"].as_u64().and_then(|seq| seq_map.get(&seq))
            {
                credits.left_out.insert(*exchange);
            }
        }
        credits
    }

    fn loss(&self, turn_id: &str, exchange: (usize, usize)) -> Loss {
        if self.clipped.contains(turn_id) {
            Loss::Clipped
        } else if self.whole.contains(turn_id) {
            Loss::Mismatch
        } else if self.turn_ids.contains(turn_id) {
            Loss::Summarised
        } else if self.left_out.contains(&exchange) {
            Loss::NoRoom
        } else {
            Loss::NotRetrieved
        }
    }
}

/// The prompt's context (every message content except the question) and its cl100k tokens. A
/// block prefixed to the question (`placement: user_prefix`) counts; the question does not.
pub fn prompt_context(prompt: &[ChatMessage], question: &str) -> (String, u32) {
    let mut parts: Vec<String> = Vec::new();
    let last = prompt.len().saturating_sub(1);
    for (index, message) in prompt.iter().enumerate() {
        let text = message.text();
        if index == last
            && message.role == "user"
            && let Some(prefix) = text.strip_suffix(question)
        {
            if !prefix.trim().is_empty() {
                parts.push(prefix.to_owned());
            }
            continue;
        }
        parts.push(text);
    }
    let tokens = parts
        .iter()
        .map(|part| count_in(Encoding::Cl100k, part))
        .sum();
    (parts.join("\n"), tokens)
}

/// Per question (in conversation order, categories 1–4), a baseline's score.
pub fn baseline_score(
    conversation: &Conversation,
    question: &dataset::Question,
    prompt: &BaselinePrompt,
) -> SystemScore {
    let evidence: Vec<String> = question
        .evidence
        .iter()
        .map(|pos| {
            conversation
                .turn(*pos)
                .map(|turn| normalise(&turn.evidence_text()))
                .unwrap_or_default()
        })
        .collect();
    let credited: Vec<bool> = question
        .evidence
        .iter()
        .map(|pos| prompt.turns.contains(pos))
        .collect();
    let score = score(
        question.category,
        &prompt.context,
        &evidence,
        &credited,
        &question.answer,
        prompt.tokens,
    );
    let missed = question
        .evidence
        .iter()
        .zip(&evidence)
        .filter(|(_, text)| text.is_empty() || !prompt.context.contains(text.as_str()))
        .map(|(pos, _)| Missed {
            dia_id: conversation
                .turn(*pos)
                .map(|turn| turn.dia_id.clone())
                .unwrap_or_default(),
            why: Loss::NotSelected,
        })
        .collect();
    SystemScore { score, missed }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_question_is_not_context() {
        let prompt = vec![
            ChatMessage::new("system", "core block"),
            ChatMessage::new("system", "recall block"),
            ChatMessage::new("user", "When did Ann adopt Tom?"),
        ];
        let (context, tokens) = prompt_context(&prompt, "When did Ann adopt Tom?");
        assert_eq!(context, "core block\nrecall block");
        assert_eq!(
            tokens,
            count_in(Encoding::Cl100k, "core block") + count_in(Encoding::Cl100k, "recall block")
        );
        let prefixed = vec![ChatMessage::new(
            "user",
            "<engram-memory>x</engram-memory>\n\nWhen?",
        )];
        let (context, _) = prompt_context(&prefixed, "When?");
        assert_eq!(context, "<engram-memory>x</engram-memory>\n\n");
        let (context, tokens) = prompt_context(&[ChatMessage::new("user", "When?")], "When?");
        assert_eq!((context.as_str(), tokens), ("", 0));
    }
}
