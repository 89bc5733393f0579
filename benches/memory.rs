//! Memory engine benchmark: one user with 2,000 recorded turns and 500 facts
//! (`ENGRAM_BENCH_TURNS` sets another number of turns, to see what a longer history costs;
//! the criterion ids keep their names).
//!
//! Prints the figures first (hot path re-rank + pack + compose percentiles, back to
//! back, spaced as at 200 req/s and with every cache cold; prefetch percentiles, per-user state
//! size), measured over many individually timed calls, then runs the same operations under
//! criterion.

#![expect(
    clippy::print_stdout,
    reason = "a benchmark reports its figures on stdout"
)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use engram_memory::config::RetrievalMode;
use engram_memory::embed;
use engram_memory::index::Segment;
use engram_memory::model::SummaryText;
use engram_memory::openai::ChatMessage;
use engram_memory::{
    CandidateId, ComposeRequest, Composition, ExchangeInput, FactDiff, FactEdit,
    HeuristicExtractor, MemoryConfig, MemoryIndex, MemoryState, apply_diff, compose, pin, prefetch,
    record_exchange, set_identity, warm_up,
};

#[path = "support/prose.rs"]
mod prose;

/// Recorded turns unless `ENGRAM_BENCH_TURNS` says otherwise.
const TURNS: usize = 2_000;
const FACTS: usize = 500;
const SESSIONS: usize = 20;

// The sidecar's allocator (src/main.rs), so the hot path is timed as it runs there.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// A tiny deterministic generator (no extra dependency).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.next() % items.len()]
    }
}

const TOPICS: &[&[&str]] = &[
    &[
        "sourdough",
        "starter",
        "hydration",
        "flour",
        "oven",
        "crust",
        "proofing",
    ],
    &[
        "marathon",
        "training",
        "tempo",
        "intervals",
        "shoes",
        "recovery",
        "pace",
    ],
    &[
        "mortgage",
        "interest",
        "rate",
        "deposit",
        "bank",
        "repayment",
        "fixed",
    ],
    &[
        "garden",
        "tomatoes",
        "compost",
        "seedlings",
        "watering",
        "pests",
        "soil",
    ],
    &[
        "python",
        "script",
        "pandas",
        "dataframe",
        "csv",
        "function",
        "loop",
    ],
    &[
        "japan",
        "kyoto",
        "train",
        "ryokan",
        "itinerary",
        "temples",
        "visa",
    ],
    &[
        "guitar", "chords", "scales", "practice", "amp", "strings", "song",
    ],
    &[
        "wedding",
        "venue",
        "guests",
        "catering",
        "budget",
        "dress",
        "photographer",
    ],
    &[
        "puppy", "training", "crate", "vet", "walks", "treats", "leash",
    ],
    &[
        "novel",
        "chapter",
        "character",
        "plot",
        "draft",
        "editor",
        "outline",
    ],
    &[
        "kitchen",
        "renovation",
        "cabinets",
        "tiles",
        "plumber",
        "quote",
        "countertop",
    ],
    &[
        "chess",
        "opening",
        "endgame",
        "tactics",
        "rating",
        "tournament",
        "blunder",
    ],
    &[
        "taxes",
        "deduction",
        "receipts",
        "accountant",
        "freelance",
        "invoice",
        "deadline",
    ],
    &[
        "camera", "lens", "aperture", "exposure", "portrait", "lighting", "editing",
    ],
    &[
        "yoga",
        "flexibility",
        "breathing",
        "poses",
        "studio",
        "balance",
        "meditation",
    ],
    &[
        "startup",
        "pitch",
        "investors",
        "prototype",
        "customers",
        "pricing",
        "runway",
    ],
];

const NAMES: &[&str] = &[
    "Maria", "Tom", "Aiko", "Lena", "Omar", "Priya", "Jonas", "Chen",
];
const PLACES: &[&str] = &[
    "Lisbon", "Berlin", "Osaka", "Denver", "Nairobi", "Lyon", "Oslo",
];

fn user_text(rng: &mut Lcg, topic: &[&str], n: usize) -> String {
    let (a, b, c) = (rng.pick(topic), rng.pick(topic), rng.pick(topic));
    match n % 9 {
        0 => format!(
            "My friend {} told me about {a} in {}. How should I think about the {b} and the {c} before next week?",
            rng.pick(NAMES),
            rng.pick(PLACES)
        ),
        1 => format!(
            "I tried the {a} idea yesterday but the {b} was off again. Could the {c} be the reason, or is it something else entirely?"
        ),
        2 => format!("I love {a}. What {b} would you recommend for someone who cares about {c}?"),
        3 => format!(
            "Quick question about {a}: is it normal that the {b} changes so much from day to day, given the {c}?"
        ),
        4 => format!(
            "I'm planning to sort out the {a} and the {b} with {} this month, what should come first?",
            rng.pick(NAMES)
        ),
        5 => format!(
            "Remember that the {a} appointment is on the {}th.",
            1 + n % 27
        ),
        6 => format!(
            "Can you compare {a} and {b} for me? I keep going back and forth, and {} thinks the {c} matters most.",
            rng.pick(NAMES)
        ),
        7 => format!("Thanks, that {a} tip about {b} worked. Any more advice on {c}?"),
        _ => format!("What is the usual mistake people make with {a} and {b}?"),
    }
}

fn assistant_text(rng: &mut Lcg, topic: &[&str]) -> String {
    let (a, b, c, d) = (
        rng.pick(topic),
        rng.pick(topic),
        rng.pick(topic),
        rng.pick(topic),
    );
    format!(
        "Good question. With {a}, the {b} usually matters more than people expect, so start there. \
         Keep notes on the {c} for a week and change one thing at a time. If the {d} still \
         looks wrong after that, it is worth asking someone with experience to take a look, \
         because small details compound quickly."
    )
}

struct Fixture {
    state: MemoryState,
    index: MemoryIndex,
    config: MemoryConfig,
    prefetched: Vec<CandidateId>,
    queries: Vec<Vec<ChatMessage>>,
    record_time: Duration,
}

/// The fixture's turns: `ENGRAM_BENCH_TURNS` when it is set to a positive number, else
/// [`TURNS`].
fn turns() -> usize {
    match std::env::var("ENGRAM_BENCH_TURNS") {
        Ok(text) if text.trim().is_empty() => TURNS,
        Ok(text) => match text.replace(['_', ','], "").parse() {
            Ok(turns) if turns > 0 => turns,
            _ => {
                println!("ENGRAM_BENCH_TURNS={text:?} is not a positive number; using {TURNS}");
                TURNS
            }
        },
        Err(_) => TURNS,
    }
}

fn build_fixture() -> Fixture {
    let config = MemoryConfig::default();
    let mut state = MemoryState::new();
    let mut rng = Lcg(42);
    set_identity(
        &mut state,
        "I am Sam, a product designer in Lisbon.\nI like short, direct answers.",
    );
    pin(&mut state, "Always give metric units.");
    pin(&mut state, "Answer in British English.");

    let turns = turns();
    let started = Instant::now();
    let mut topic = 0;
    for n in 0..turns {
        // Topics run for ~12 turns, so episodes form.
        if n % 12 == 0 {
            topic = rng.next() % TOPICS.len();
        }
        let words = TOPICS[topic];
        let mut user = user_text(&mut rng, words, n);
        if n % 97 == 3 {
            user.push_str(" By the way, I'm allergic to sesame.");
        }
        if n % 250 == 10 {
            user.push_str(&format!(" I moved to {}.", rng.pick(PLACES)));
        }
        let assistant = assistant_text(&mut rng, words);
        record_exchange(
            &mut state,
            &ExchangeInput {
                session_id: format!("session-{}", n * SESSIONS / turns),
                turn_id: format!("turn-{n:05}"),
                user_text: user,
                assistant_text: assistant,
                event_time: Some(format!(
                    "2023-{:02}-{:02}T{:02}:00:00Z",
                    1 + (n / 170) % 12,
                    1 + (n / 6) % 28,
                    8 + n % 12
                )),
                prior_chain: None,
                incomplete: false,
                arrival: None,
            },
            &HeuristicExtractor,
            &config,
        );
    }
    let record_time = started.elapsed() / turns as u32;

    // Top the base truth up to 500 facts, each grounded in a recorded turn.
    let missing = FACTS.saturating_sub(state.active_facts().count());
    for n in 0..missing {
        let words = TOPICS[n % TOPICS.len()];
        let seq = (n * 7 % turns) as u32;
        apply_diff(
            &mut state,
            &FactDiff {
                add: vec![FactEdit::new(format!(
                    "{} preference {n}: prefers {} with {} over {}",
                    words[0],
                    words[1 + n % 6],
                    rng.pick(NAMES),
                    words[1 + (n + 3) % 6]
                ))],
                ..FactDiff::default()
            },
            Some(seq),
        );
    }
    // As the proxy's cache holds a memory: written, so its lookups are current and a request
    // reads the working set through them.
    state.take_changes();
    let index = MemoryIndex::build(&state);
    let prefetched = prefetch(&state, &index, "session-19", &config.retrieval);

    let mut queries = Vec::new();
    for n in 0..64 {
        let words = TOPICS[n % TOPICS.len()];
        let question = match n % 4 {
            0 => format!(
                "What did we say about the {} and the {}?",
                words[1], words[3]
            ),
            1 => format!("When did I mention {} and {}?", rng.pick(NAMES), words[0]),
            2 => format!("Any more ideas on {}?", words[2]),
            _ => "Can you recap what I'm allergic to and where I live?".to_string(),
        };
        queries.push(vec![
            ChatMessage::new("system", "You are a helpful assistant."),
            ChatMessage::new("user", question),
        ]);
    }
    Fixture {
        state,
        index,
        config,
        prefetched,
        queries,
        record_time,
    }
}

fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration, Duration) {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    (at(0.5), at(0.99), at(1.0))
}

/// Heap bytes of the state's strings and vectors (an estimate: allocator overhead excluded).
fn estimated_heap_bytes(state: &MemoryState) -> usize {
    use std::mem::size_of_val;
    let strings = |texts: &[&String]| texts.iter().map(|text| text.capacity()).sum::<usize>();
    use engram_memory::model::{Artifact, EpisodeManifest, Fact, RawTurn, TurnLogEntry};
    let mut bytes = state.facts.len() * size_of::<Fact>()
        + state.raw_turns.len() * size_of::<RawTurn>()
        + state.turn_log.len() * size_of::<TurnLogEntry>()
        + state.episodes.len() * size_of::<EpisodeManifest>()
        + state.artifacts.len() * size_of::<Artifact>()
        + size_of_val(state.pinned.as_slice());
    for fact in &state.facts {
        bytes += strings(&[&fact.key, &fact.value]) + fact.provenance.capacity() * 4;
        bytes += fact.date.as_ref().map_or(0, String::capacity);
        for revision in &fact.history {
            bytes += size_of_val(revision)
                + revision.value.capacity()
                + revision.provenance.capacity() * 4;
        }
    }
    for turn in &state.raw_turns {
        bytes += turn.id.len() + turn.user.len() + turn.assistant.len();
        bytes += turn.event_time.as_ref().map_or(0, |time| time.len());
    }
    for entry in &state.turn_log {
        for side in [&entry.user_summary, &entry.assistant_summary] {
            if let SummaryText::Text(text) = side {
                bytes += text.len();
            }
        }
        bytes += entry.facts.len() * 4 + entry.artifacts.len() * 4;
    }
    for episode in &state.episodes {
        bytes += strings(&[&episode.topic, &episode.summary]);
        bytes += episode.salience_tags.heap_bytes() + episode.rehydration_hints.heap_bytes();
        bytes += episode.links.capacity() * 4 + episode.facts.capacity() * 4;
    }
    for artifact in &state.artifacts {
        bytes += artifact.content.capacity();
    }
    bytes
}

fn report(fixture: &Fixture) {
    let Fixture {
        state,
        index,
        config,
        prefetched,
        record_time,
        ..
    } = fixture;
    println!(
        "fixture: {} turns, {} active facts, {} episodes, {} artifacts, {} prefetched candidates",
        state.raw_turns.len(),
        state.active_facts().count(),
        state.episodes.len(),
        state.artifacts.len(),
        prefetched.len()
    );
    println!(
        "record_exchange (heuristic extractor), mean over the fixture's turns: {record_time:?}"
    );

    // Hot path: re-rank the prefetched candidates + search + pack + compose, in the default
    // (hybrid) retrieval mode, then lexical-only for comparison.
    let mut lexical = config.clone();
    lexical.retrieval.mode = RetrievalMode::Lexical;
    for (mode, config) in [("hybrid", config), ("lexical", &lexical)] {
        let mut samples = Vec::with_capacity(20_000);
        let mut items = 0;
        let mut tokens = 0;
        for round in 0..20_000 {
            let started = Instant::now();
            let composition = compose_query(fixture, config, round);
            samples.push(started.elapsed());
            items += composition.items;
            tokens += composition.tokens.total as usize;
            black_box(composition);
        }
        let (p50, p99, max) = percentiles(samples);
        println!(
            "compose ({mode}; re-rank + search + pack + compose), 20,000 calls: p50 {p50:?}, p99 {p99:?}, max {max:?} (target p99 < 200 µs); mean {} items, {} tokens injected of {}",
            items / 20_000,
            tokens / 20_000,
            config.budget_tokens
        );
    }
    report_spaced(fixture);
    report_nearest();

    let mut samples = Vec::with_capacity(500);
    for _ in 0..500 {
        let started = Instant::now();
        black_box(prefetch(state, index, "session-19", &config.retrieval));
        samples.push(started.elapsed());
    }
    let (p50, p99, max) = percentiles(samples);
    println!("prefetch, 500 calls: p50 {p50:?}, p99 {p99:?}, max {max:?} (target < 5 ms)");

    let started = Instant::now();
    let rebuilt = MemoryIndex::build(state);
    println!(
        "index build from scratch: {:?}; index heap estimate {:.2} MB",
        started.elapsed(),
        rebuilt.estimated_bytes() as f64 / 1e6
    );

    let size =
        |value: serde_json::Result<Vec<u8>>| value.map_or(0, |bytes| bytes.len()) as f64 / 1e6;
    println!(
        "  JSON by part: raw turns {:.2} MB, turn log {:.2} MB, facts {:.2} MB, episodes {:.2} MB",
        size(serde_json::to_vec(&state.raw_turns)),
        size(serde_json::to_vec(&state.turn_log)),
        size(serde_json::to_vec(&state.facts)),
        size(serde_json::to_vec(&state.episodes)),
    );
    let text: usize = state
        .raw_turns
        .iter()
        .map(|turn| turn.user.len() + turn.assistant.len())
        .sum();
    println!("  raw exchange text alone: {:.2} MB", text as f64 / 1e6);
    let json = serde_json::to_vec(state).unwrap_or_default();
    println!(
        "state size per user: serialized JSON {:.2} MB, heap estimate {:.2} MB (target < 2 MB)",
        json.len() as f64 / 1e6,
        estimated_heap_bytes(state) as f64 / 1e6
    );
}

/// The hot path's compose for the fixture's query number `round` (they repeat).
fn compose_query(fixture: &Fixture, config: &MemoryConfig, round: usize) -> Composition {
    compose(
        &fixture.state,
        &fixture.index,
        &fixture.prefetched,
        &ComposeRequest {
            session_id: "session-19",
            messages: &fixture.queries[round % fixture.queries.len()],
            model: "gpt-4o",
            unapplied: &[],
        },
        config,
    )
}

/// Calls spaced as at 200 req/s.
const SPACED_GAP: Duration = Duration::from_millis(5);
const SPACED_CALLS: usize = 1_000;
/// Bytes written between calls to leave every cache cold: twice this VM's last-level cache
/// (32 MiB).
const EVICTING_BYTES: usize = 64 << 20;

/// Compose as a sidecar at 200 req/s calls it: one call every 5 ms, the thread asleep between
/// (back to back, the loop above keeps the index in the CPU's caches; a real request finds
/// them cold). Then, as a repeatable bound, each call after writing enough memory to leave
/// every cache cold: a sleeping core loses its caches only to whatever else ran.
fn report_spaced(fixture: &Fixture) {
    let mut evicting = vec![0u8; EVICTING_BYTES];
    for cold in [false, true] {
        let mut samples = Vec::with_capacity(SPACED_CALLS);
        for round in 0..SPACED_CALLS {
            if cold {
                // One write per cache line.
                for (at, byte) in evicting.iter_mut().enumerate().step_by(64) {
                    *byte = at as u8;
                }
                black_box(&evicting);
            } else {
                std::thread::sleep(SPACED_GAP);
            }
            let started = Instant::now();
            black_box(compose_query(fixture, &fixture.config, round));
            samples.push(started.elapsed());
        }
        let (p50, p99, max) = percentiles(samples);
        let how = if cold {
            format!(
                "each after {} MiB written (every cache cold)",
                EVICTING_BYTES >> 20
            )
        } else {
            format!("one every {SPACED_GAP:?} (as at 200 req/s)")
        };
        println!(
            "compose (hybrid), {SPACED_CALLS} calls {how}: p50 {p50:?}, p99 {p99:?}, max {max:?}"
        );
    }
}

/// Semantic search over a 50,000-turn history's vectors: the sign-code prefilter and
/// `semantic_candidates` dot products, against scoring every vector.
fn report_nearest() {
    const ITEMS: u32 = 50_000;
    let Some(model) = embed::model() else {
        println!("nearest: the embedded model did not parse");
        return;
    };
    let mut rng = Lcg(7);
    let mut segment = Segment::default();
    let started = Instant::now();
    for key in 0..ITEMS {
        let topic = TOPICS[rng.next() % TOPICS.len()];
        let text = user_text(&mut rng, topic, key as usize);
        segment.set_vector(key, model.embed(&text));
    }
    println!(
        "embedding {ITEMS} turns' text: {:?} per turn",
        started.elapsed() / ITEMS
    );
    let queries: Vec<_> = (0..64)
        .filter_map(|n| {
            let words = TOPICS[n % TOPICS.len()];
            model.embed(&format!(
                "What did we say about the {} and the {}?",
                words[1], words[3]
            ))
        })
        .collect();
    let retrieval = MemoryConfig::default().retrieval;
    let pool = retrieval.semantic_candidates;
    let every = ITEMS as usize;
    for (label, pool, scan) in [
        (
            "prefilter, the newest semantic_scan_items",
            pool,
            retrieval.semantic_scan_items,
        ),
        ("prefilter, every item", pool, every),
        ("every vector", every, every),
    ] {
        let mut samples = Vec::with_capacity(500);
        for round in 0..500 {
            let started = Instant::now();
            black_box(segment.nearest(&queries[round % queries.len()], pool, scan, 24));
            samples.push(started.elapsed());
        }
        let (p50, p99, max) = percentiles(samples);
        println!(
            "nearest over {ITEMS} vectors ({label}, {pool} scored), 500 calls: p50 {p50:?}, p99 {p99:?}, max {max:?}"
        );
    }
    // How much of the exact top 24 the prefilter keeps.
    let mut kept = 0;
    for query in &queries {
        let exact: Vec<u32> = segment
            .nearest(query, every, every, 24)
            .best
            .iter()
            .take(24)
            .map(|hit| hit.0)
            .collect();
        let pre: Vec<u32> = segment
            .nearest(query, pool, every, 24)
            .best
            .iter()
            .take(24)
            .map(|hit| hit.0)
            .collect();
        kept += exact.iter().filter(|key| pre.contains(key)).count();
    }
    println!(
        "prefilter keeps {:.1} % of the exact top 24 ({} queries)",
        kept as f64 * 100.0 / (24 * queries.len()) as f64,
        queries.len()
    );
}

/// The hot path when a user pastes a long document each turn, as in the overhead benchmark's
/// body scenario: 15 recorded turns of the same `size`-byte text, then a compose for it again.
fn report_pasted(size: usize) {
    const PASTED_TURNS: usize = 15;
    let config = MemoryConfig::default();
    let mut state = MemoryState::new();
    let user_text = format!(
        "{} Summarise the plot in two sentences.",
        prose::prose(size)
    );
    let recording = Instant::now();
    for n in 0..PASTED_TURNS {
        record_exchange(
            &mut state,
            &ExchangeInput {
                session_id: "pasted".into(),
                turn_id: format!("turn-{n:02}"),
                user_text: user_text.clone(),
                assistant_text: "A keeper tends a lighthouse; a storm tests him.".into(),
                event_time: None,
                prior_chain: None,
                incomplete: false,
                arrival: None,
            },
            &HeuristicExtractor,
            &config,
        );
    }
    println!(
        "record_exchange with a pasted {} KB message (the worker's engine pass, heuristic extractor), mean over {PASTED_TURNS} turns: {:?}",
        size / 1000,
        recording.elapsed() / PASTED_TURNS as u32
    );
    let index = MemoryIndex::build(&state);
    let prefetched = prefetch(&state, &index, "pasted", &config.retrieval);
    let messages = vec![
        ChatMessage::new("system", "You are a helpful assistant."),
        ChatMessage::new("user", user_text),
    ];
    let request = ComposeRequest {
        session_id: "pasted",
        messages: &messages,
        model: "gpt-4o",
        unapplied: &[],
    };
    let mut samples = Vec::with_capacity(300);
    for _ in 0..300 {
        let started = Instant::now();
        black_box(compose(&state, &index, &prefetched, &request, &config));
        samples.push(started.elapsed());
    }
    let (p50, p99, max) = percentiles(samples);
    println!(
        "compose with a pasted {} KB message ({PASTED_TURNS} such turns recorded), 300 calls: p50 {p50:?}, p99 {p99:?}, max {max:?}",
        size / 1000
    );
}

fn main() {
    warm_up();
    let fixture = build_fixture();
    report(&fixture);
    for size in [100_000, 1_000_000] {
        report_pasted(size);
    }

    let mut criterion = Criterion::default()
        .sample_size(50)
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let request = ComposeRequest {
        session_id: "session-19",
        messages: &fixture.queries[0],
        model: "gpt-4o",
        unapplied: &[],
    };
    criterion.bench_function("compose_2000_turns_500_facts", |bencher| {
        bencher.iter(|| {
            compose(
                &fixture.state,
                &fixture.index,
                &fixture.prefetched,
                black_box(&request),
                &fixture.config,
            )
        })
    });
    criterion.bench_function("prefetch_2000_turns_500_facts", |bencher| {
        bencher.iter(|| {
            prefetch(
                &fixture.state,
                &fixture.index,
                black_box("session-19"),
                &fixture.config.retrieval,
            )
        })
    });
    criterion.final_summary();
}
