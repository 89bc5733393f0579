//! The worker's computation per job as one user's history grows, without the store or the
//! scheduler: what `worker::compute` does for one turn (copy the cached memory, record the
//! exchange with the heuristic extractor, refresh the index, take the changes, prefetch, encode
//! what the store would write), timed per turn on the history benchmark's turns, single thread.
//! Wall time: run it on an otherwise idle machine (`flock -x /tmp/engram-cpu.lock` here).
//!
//! Run with `cargo bench --bench apply_growth -- [TURNS]` (default 50,000). It prints p50, p99
//! and the maximum per window of 1,000 turns at 1,000, 10,000 and every further 10,000, so
//! growth with history shows apart from the store's commit and from CPU shared with requests
//! (issue 26's target: apply p99 ≤ 5 ms at every size, measured by `benches/history.sh`).
//! Beside it, the hot path's side: after each turn, one `compose` for the next request (the
//! history benchmark's short message, with the prefetch just made), timed on its own.
//!
//! Not a test: it prints numbers and asserts nothing.

#![expect(
    clippy::print_stdout,
    reason = "a benchmark reports its figures on stdout"
)]

#[path = "history/text.rs"]
mod text;

use std::time::{Duration, Instant};

use engram_memory::openai::ChatMessage;
use engram_memory::{
    ComposeRequest, HeuristicExtractor, MemoryConfig, compose, record_exchange, warm_up,
};
use engram_proxy::cache::CachedMemory;
use engram_store::EncodedState;

const SESSION: &str = "solo-session";

// The sidecar's allocator (src/main.rs): glibc's malloc made a fifth of this benchmark's
// samples and grows with the heap, which the worker in `engram` does not pay.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo test --all-targets` runs harness-less benches with `--test`: nothing to do here.
    if args.iter().any(|arg| arg == "--test") {
        return;
    }
    let turns: u64 = args
        .iter()
        .find_map(|arg| arg.replace(['_', ','], "").parse().ok())
        .unwrap_or(50_000);
    warm_up();
    let config = MemoryConfig::default();
    let mut memory = CachedMemory::new(engram_memory::MemoryState::new());
    let mut window: Vec<Duration> = Vec::with_capacity(1_000);
    // Per job: record, index refresh, prefetch, encode.
    let mut phases: Vec<[Duration; 4]> = Vec::with_capacity(1_000);
    let mut composes: Vec<Duration> = Vec::with_capacity(1_000);
    let started = Instant::now();
    println!(
        "apply per job (copy + record_exchange + index refresh + prefetch + encode), one user, single thread"
    );
    println!(
        "| turns | p50 (ms) | p99 (ms) | max (ms) | mean (ms) | p99 of record / index / prefetch / encode (ms) | compose p50 / p99 (ms) | working set (facts / summaries) | memory estimated / process RSS (MiB) |"
    );
    println!("|--:|--:|--:|--:|--:|--|--|--|--|");
    for n in 0..turns {
        let exchange = text::exchange(n, SESSION, format!("turn-{n:08}"));
        let start = Instant::now();
        let mut state = memory.state.clone();
        record_exchange(&mut state, &exchange, &HeuristicExtractor, &config);
        let recorded = start.elapsed();
        let mut next = CachedMemory::advanced(Some(&memory), state);
        let indexed = start.elapsed();
        let changes = next.state.take_changes();
        let prefetched =
            engram_memory::prefetch(&next.state, &next.index, SESSION, &config.retrieval);
        let fetched = start.elapsed();
        let encoded = EncodedState::changes(&next.state, &changes);
        let end = start.elapsed();
        window.push(end);
        phases.push([
            recorded,
            indexed - recorded,
            fetched - indexed,
            end - fetched,
        ]);
        std::hint::black_box(encoded.is_ok());
        // The next request's compose, on the memory just written (as a warm request finds it).
        let messages = [ChatMessage::new(
            "user",
            text::user_text(text::REQUEST_SEED + n),
        )];
        let request = ComposeRequest {
            session_id: SESSION,
            messages: &messages,
            model: "gpt-4o",
            unapplied: &[],
        };
        let start = Instant::now();
        std::hint::black_box(compose(
            &next.state,
            &next.index,
            &prefetched,
            &request,
            &config,
        ));
        composes.push(start.elapsed());
        memory = next;

        let done = n + 1;
        if window.len() == 1_000 {
            if done == 1_000 || done % 10_000 == 0 || done == turns {
                let lookups = &memory.state.lookups;
                let working = (
                    lookups.working_facts().len(),
                    lookups.working_summaries().len(),
                );
                report(
                    done,
                    &mut window,
                    &phases,
                    &mut composes,
                    working,
                    memory.bytes,
                );
            }
            window.clear();
            phases.clear();
            composes.clear();
        }
    }
    println!("{turns} turns in {:.1} s", started.elapsed().as_secs_f64());
}

fn report(
    turns: u64,
    window: &mut [Duration],
    phases: &[[Duration; 4]],
    composes: &mut [Duration],
    (working_facts, working_summaries): (usize, usize),
    estimated_bytes: usize,
) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let p99 = |mut samples: Vec<Duration>| {
        samples.sort_unstable();
        samples[((samples.len() as f64 - 1.0) * 0.99).round() as usize]
    };
    let by_phase: Vec<String> = (0..4)
        .map(|phase| format!("{:.3}", ms(p99(phases.iter().map(|p| p[phase]).collect()))))
        .collect();
    window.sort_unstable();
    let at = |q: f64| window[((window.len() as f64 - 1.0) * q).round() as usize];
    let mean = window.iter().sum::<Duration>() / window.len() as u32;
    composes.sort_unstable();
    let compose_at = |q: f64| composes[((composes.len() as f64 - 1.0) * q).round() as usize];
    println!(
        "| {turns} | {:.3} | {:.3} | {:.3} | {:.3} | {} | {:.3} / {:.3} | {working_facts} / {working_summaries} | {:.1} / {} |",
        ms(at(0.5)),
        ms(at(0.99)),
        ms(at(1.0)),
        ms(mean),
        by_phase.join(" / "),
        ms(compose_at(0.5)),
        ms(compose_at(0.99)),
        estimated_bytes as f64 / MIB,
        rss_mib().map_or_else(|| "?".to_owned(), |rss| format!("{rss:.1}")),
    );
}

const MIB: f64 = 1024.0 * 1024.0;

/// The process's resident set (`VmRSS` in `/proc/self/status`), in MiB; `None` off Linux.
fn rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}
