//! Property tests of the memory layout: however a history arrives, the memory kept as
//! copy-on-write chunks, written to the store as changed items and read back as deltas, and
//! the index kept as LSM parts refreshed from changes, give exactly the memory view of the
//! simple reference model (every turn recorded on one plain state, the state stored and read
//! back whole, the index built afresh).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests: a failure should fail the test loudly"
)]

use std::sync::Arc;

use engram_memory::index::Bm25;
use engram_memory::manifest::build_manifest;
use engram_memory::openai::ChatMessage;
use engram_memory::{
    ComposeRequest, ExchangeInput, HeuristicExtractor, MemoryConfig, MemoryIndex, MemoryState,
    compose, consolidate, record_exchange,
};
use engram_proxy::cache::CachedMemory;
use engram_store::{EmbeddedStore, EncodedState, MemoryRecords, UserKey};
use proptest::prelude::*;

const WORDS: &[&str] = &[
    "porto",
    "lisbon",
    "hiking",
    "peanuts",
    "allergic",
    "sister",
    "rita",
    "dog",
    "rex",
    "japan",
    "april",
    "grant",
    "deadline",
    "sourdough",
    "starter",
    "marathon",
    "radiohead",
    "locker",
    "code",
    "tonight",
    "curry",
    "alps",
    "madrid",
    "moved",
];

const SENTENCES: &[&str] = &[
    "I'm allergic to peanuts.",
    "I live in Porto.",
    "I moved from Porto to Madrid.",
    "My name is Ines Costa.",
    "Please remember that my locker code is 4512.",
    "My dog's name is Rex.",
    "My sister Rita visits in June.",
    "Never book me on a red-eye flight.",
];

/// One turn: a sentence (or none), a few words, a session.
type Turn = (Option<usize>, Vec<usize>, u8);

fn history() -> impl Strategy<Value = Vec<Turn>> {
    prop::collection::vec(
        (
            prop::option::weighted(0.4, 0..SENTENCES.len()),
            prop::collection::vec(0..WORDS.len(), 1..8),
            0u8..3,
        ),
        150..420,
    )
}

fn exchange(n: usize, turn: &Turn) -> ExchangeInput {
    let (sentence, words, session) = turn;
    let said: Vec<&str> = words.iter().map(|word| WORDS[*word]).collect();
    let user_text = match sentence {
        Some(sentence) => format!("{} Also {}.", SENTENCES[*sentence], said.join(" ")),
        None => format!("Tell me about {}.", said.join(" ")),
    };
    ExchangeInput {
        session_id: format!("s{session}"),
        turn_id: format!("t{n}"),
        user_text,
        assistant_text: format!("About {}: noted, turn {n}.", said.join(" and ")),
        ..ExchangeInput::default()
    }
}

/// Searches every segment of both indexes for a few queries and compares the hits.
fn assert_same_search(incremental: &MemoryIndex, fresh: &MemoryIndex) {
    let bm25 = Bm25::STANDARD;
    for query in [
        "porto madrid moved",
        "allergic peanuts",
        "sister rita june",
        "dog rex hiking alps",
        "locker code",
        "japan april grant deadline",
    ] {
        let (mine, _) = incremental.query_terms(query);
        let (theirs, _) = fresh.query_terms(query);
        for (a, b) in [
            (&incremental.raw, &fresh.raw),
            (&incremental.summaries, &fresh.summaries),
            (&incremental.facts, &fresh.facts),
            (&incremental.episodes, &fresh.episodes),
            (&incremental.artifacts, &fresh.artifacts),
        ] {
            assert_eq!(a.len(), b.len(), "{query}");
            let hits = a.search(&mine, bm25, 50);
            let expected = b.search(&theirs, bm25, 50);
            assert_eq!(hits.len(), expected.len(), "{query}");
            for ((key, score), (expected_key, expected_score)) in hits.iter().zip(&expected) {
                assert_eq!(key, expected_key, "{query}");
                assert!((score - expected_score).abs() < 1e-5, "{query}");
            }
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    #[test]
    fn the_layout_gives_the_reference_models_memory(history in history()) {
        let config = MemoryConfig::default();
        let runtime = runtime();
        let store = EmbeddedStore::in_memory().unwrap();
        let user = UserKey::new("t", "u");

        let mut reference = MemoryState::new();
        let mut cached = Arc::new(CachedMemory::new(MemoryState::new()));
        // A second reader that only ever catches up through the store.
        let mut reader: Option<Arc<CachedMemory>> = None;
        for (n, turn) in history.iter().enumerate() {
            let exchange = exchange(n, turn);
            record_exchange(&mut reference, &exchange, &HeuristicExtractor, &config);

            // The worker's way: a copy of the cached memory, the turn, the changed items.
            let previous = cached.state.version;
            let mut state = cached.state.clone();
            record_exchange(&mut state, &exchange, &HeuristicExtractor, &config);
            let mut next = CachedMemory::advanced(Some(&cached), state);
            let changes = next.state.take_changes();
            let encoded = EncodedState::changes(&next.state, &changes).unwrap();
            runtime
                .block_on(store.save_encoded_state(&user, &encoded, previous))
                .unwrap();
            cached = Arc::new(next);

            // Every few turns the reader catches up: by delta while the ring reaches it.
            if n % 7 == 6 {
                let known = reader.as_ref().map(|memory| memory.version());
                let record = runtime
                    .block_on(store.hot_record(&user, "s0", known))
                    .unwrap();
                reader = CachedMemory::resolve(reader.clone(), record.version, record.update)
                    .unwrap();
            }
        }
        let mut incremental = cached.state.clone();
        incremental.take_changes();
        prop_assert_eq!(&incremental, &reference);

        // Stored and read back whole: the reference model's memory.
        let stored = runtime.block_on(store.load_state(&user)).unwrap().unwrap();
        prop_assert_eq!(&stored, &reference);

        // The reader that only took deltas holds it too, once it catches up.
        let record = runtime
            .block_on(store.hot_record(&user, "s0", reader.as_ref().map(|m| m.version())))
            .unwrap();
        let reader = CachedMemory::resolve(reader, record.version, record.update)
            .unwrap()
            .unwrap();
        prop_assert_eq!(&reader.state, &reference);

        // After a consolidation every manifest is what a rebuild from its turns gives: a fact
        // change refreshes only the episode's fact list, the one part that depends on facts.
        let mut consolidated = reference.clone();
        consolidate(&mut consolidated);
        consolidated.sync_lookups();
        for episode in consolidated.episodes.iter().filter(|episode| !episode.erased) {
            let rebuilt = build_manifest(
                &consolidated,
                episode.id,
                episode.session,
                &episode.links,
                episode.rehydrated_at.clone(),
            );
            prop_assert_eq!(&rebuilt, &**episode);
        }

        // The LSM index, refreshed turn by turn, searches like one built afresh.
        let fresh = MemoryIndex::build(&reference);
        assert_same_search(&cached.index, &fresh);
        assert_same_search(&reader.index, &fresh);

        // A request composed from the cached memory (through its lookups: the working set and
        // the hard constraints) gets the prompt that a scan of every fact gives (the memory
        // read back whole has no lookups built).
        prop_assert!(cached.state.lookups.is_current(&cached.state));
        prop_assert!(!stored.lookups.is_current(&stored));
        for text in ["Where do I go hiking?", "What am I allergic to?", "grant deadline"] {
            let messages = [ChatMessage::new("user", text)];
            let request = ComposeRequest {
                session_id: "s0",
                messages: &messages,
                model: "gpt-4o",
                unapplied: &[],
            };
            let mine = compose(&cached.state, &cached.index, &[], &request, &config);
            let theirs = compose(&stored, &fresh, &[], &request, &config);
            prop_assert_eq!(&mine.messages, &theirs.messages, "{}", text);
        }
    }
}
