//! Scenario tests from the seed notes, through the engine's public API only.

use engram_memory::model::{FactCategory, RevisionEnd, Tier};
use engram_memory::openai::ChatMessage;
use engram_memory::{
    ComposeRequest, Composition, ExchangeInput, HeuristicExtractor, ItemRef, MemoryConfig,
    MemoryIndex, MemoryState, Provenance, RecordOutcome, compose, prefetch, record_exchange,
    strip_fences,
};

const SESSION: &str = "session-1";

struct Conversation {
    state: MemoryState,
    config: MemoryConfig,
    turns: usize,
}

impl Conversation {
    fn new(config: MemoryConfig) -> Conversation {
        Conversation {
            state: MemoryState::new(),
            config,
            turns: 0,
        }
    }

    fn say(&mut self, user: &str, assistant: &str) -> RecordOutcome {
        let n = self.turns;
        self.turns += 1;
        record_exchange(
            &mut self.state,
            &ExchangeInput {
                session_id: SESSION.into(),
                turn_id: format!("turn-{n}"),
                user_text: user.into(),
                assistant_text: assistant.into(),
                event_time: Some(format!(
                    "2024-{:02}-{:02}T18:30:00Z",
                    1 + n / 28,
                    1 + n % 28
                )),
                prior_chain: None,
                incomplete: false,
                arrival: None,
            },
            &HeuristicExtractor,
            &self.config,
        )
    }

    /// The composition for `question`, and the prompt it makes.
    fn ask(&self, question: &str) -> (Composition, Vec<ChatMessage>) {
        let index = MemoryIndex::build(&self.state);
        let prefetched = prefetch(&self.state, &index, SESSION, &self.config.retrieval);
        let messages = [
            ChatMessage::new("system", "You are a helpful assistant."),
            ChatMessage::new("user", question),
        ];
        let composition = compose(
            &self.state,
            &index,
            &prefetched,
            &ComposeRequest {
                session_id: SESSION,
                messages: &messages,
                model: "gpt-4o-mini",
                unapplied: &[],
            },
            &self.config,
        );
        let prompt = composition.prompt(&messages).into_iter().cloned().collect();
        (composition, prompt)
    }
}

/// Varied small talk on many topics, so nothing but its own words links the turns.
const FILLER: &[(&str, &str)] = &[
    (
        "What's a good stretch for lower back pain?",
        "Try the cat-cow stretch slowly each morning.",
    ),
    (
        "How do I change a bike tyre?",
        "Release the brake, lever the tyre off, swap the tube.",
    ),
    (
        "Explain compound interest simply.",
        "Interest earns interest: growth accelerates over time.",
    ),
    (
        "Which houseplants survive low light?",
        "Snake plants, pothos and ZZ plants tolerate shade.",
    ),
    (
        "How long should I boil an egg?",
        "Nine minutes for hard boiled, six for jammy yolks.",
    ),
    (
        "Tips for a job interview tomorrow?",
        "Research the company, prepare stories, arrive early.",
    ),
    ("What is the capital of Australia?", "Canberra, not Sydney."),
    (
        "How do solar panels work?",
        "Photovoltaic cells turn sunlight into direct current.",
    ),
    (
        "Recommend a sci-fi novel.",
        "Try The Left Hand of Darkness by Ursula Le Guin.",
    ),
    (
        "How can I sleep better?",
        "Keep a schedule, dim lights, avoid screens late.",
    ),
    (
        "What's the offside rule in football?",
        "An attacker ahead of the last defender when passed to.",
    ),
    (
        "How do I clean a cast iron pan?",
        "Scrub with salt, dry on heat, oil lightly.",
    ),
    (
        "Explain what a mortgage is.",
        "A loan secured on a house, repaid over years.",
    ),
    (
        "Best way to learn guitar chords?",
        "Start with G, C, D and E minor; practise changes.",
    ),
    (
        "What causes thunderstorms?",
        "Warm moist air rises fast and forms tall clouds.",
    ),
    (
        "How do vaccines train immunity?",
        "They show the immune system a harmless antigen.",
    ),
    (
        "Suggest a weekend hike near mountains.",
        "Pick a loop trail under fifteen kilometres.",
    ),
    (
        "How do I negotiate rent?",
        "Compare local prices and offer a longer lease.",
    ),
    (
        "What's a haiku?",
        "A three-line poem of five, seven and five syllables.",
    ),
    (
        "Why is the sky blue?",
        "Air scatters short blue wavelengths more than red.",
    ),
];

#[test]
fn early_allergy_survives_forty_turns() {
    let mut chat = Conversation::new(MemoryConfig {
        budget_tokens: 1024,
        ..MemoryConfig::default()
    });
    chat.say(
        "Before anything else: I'm allergic to shellfish, it's serious.",
        "Understood, I'll keep shellfish out of every suggestion.",
    );
    for n in 1..39 {
        let (user, assistant) = FILLER[n % FILLER.len()];
        chat.say(user, assistant);
    }
    let (composition, prompt) = chat.ask("Can you suggest a seafood dinner for Saturday?");
    assert_eq!(chat.state.raw_turns.len(), 39);

    let fact = chat
        .state
        .active_facts()
        .find(|fact| fact.key == "allergic to shellfish")
        .expect("the allergy is a fact");
    assert_eq!(fact.category, FactCategory::HardConstraint);
    assert_eq!(fact.provenance, [0]);
    assert_ne!(
        fact.tier.tier,
        Tier::Old,
        "hard constraints are never demoted"
    );

    let core = prompt[1].text();
    assert!(core.contains("kind=\"core\""), "{core}");
    assert!(
        core.contains("## Constraints the user stated\n- “allergic to shellfish” [2024-01-01]"),
        "{core}"
    );
    let mut explain = composition.explain.clone();
    assert_eq!(explain.name_turns(&chat.state), Provenance::Named);
    let explained = explain
        .items
        .iter()
        .find(|item| item.item == ItemRef::Fact(fact.id))
        .expect("explained");
    assert_eq!(explained.provenance, ["turn-0"]);
    assert!(composition.tokens.total <= 1024);
}

#[test]
fn a_topic_left_and_returned_to_is_rehydrated() {
    let mut chat = Conversation::new(MemoryConfig::default());
    let sourdough = [
        (
            "My sourdough starter smells like acetone, is it dead?",
            "It is hungry, not dead: feed it twice daily.",
        ),
        (
            "Should I use rye flour for the sourdough starter?",
            "Rye speeds fermentation; mix it half and half.",
        ),
        (
            "What hydration for a first sourdough loaf?",
            "Start at 70 percent hydration, it is easier to shape.",
        ),
        (
            "My sourdough loaf came out flat and dense.",
            "Lengthen bulk fermentation and build more tension.",
        ),
    ];
    for (user, assistant) in sourdough {
        chat.say(user, assistant);
    }
    for n in 0..36 {
        let (user, assistant) = FILLER[n % FILLER.len()];
        chat.say(user, assistant);
    }
    for seq in 0..4 {
        let entry = &chat.state.turn_log[seq];
        assert_eq!(entry.tier.tier, Tier::Old, "turn {seq} was demoted");
        let episode = entry.episode.expect("folded into an episode");
        let manifest = &chat.state.episodes[episode as usize];
        assert!(manifest.links.contains(&(seq as u32)));
        assert!(
            manifest.salience_tags.iter().any(|tag| tag == "sourdough"),
            "{manifest:?}"
        );
    }

    let outcome = chat.say(
        "Back to my sourdough: the starter smells like acetone again.",
        "Feed it more often and keep it warmer.",
    );
    assert!(!outcome.tiers.rehydrated.is_empty());
    let sourdough_episode = chat.state.turn_log[0].episode;
    assert!(
        outcome
            .tiers
            .rehydrated
            .iter()
            .any(|id| Some(*id) == sourdough_episode)
    );
    for seq in 0..4 {
        assert_eq!(
            chat.state.turn_log[seq].tier.tier,
            Tier::New,
            "turn {seq} is back in NEW"
        );
    }

    let (_, prompt) = chat.ask("What hydration did we settle on for the sourdough loaf?");
    let recall = prompt
        .iter()
        .map(ChatMessage::text)
        .find(|text| text.contains("kind=\"recall\""))
        .expect("a recall block");
    assert!(recall.contains("70 percent hydration"), "{recall}");
}

#[test]
fn a_move_updates_the_fact_and_keeps_its_history() {
    let mut chat = Conversation::new(MemoryConfig::default());
    chat.say(
        "Hi! I live in Paris and work as a translator.",
        "Bonjour! Nice to meet you.",
    );
    for (user, assistant) in &FILLER[..10] {
        chat.say(user, assistant);
    }
    let outcome = chat.say(
        "Big news: I moved from Paris to Berlin last month.",
        "Congratulations on the move to Berlin!",
    );
    assert_eq!(outcome.diff.updated.len(), 1);

    let fact = chat
        .state
        .active_facts()
        .find(|fact| fact.key == "lives in")
        .expect("a place fact");
    assert_eq!(fact.value, "Berlin");
    assert_eq!(fact.version, 2);
    assert_eq!(fact.provenance, [11]);
    assert_eq!(fact.history.len(), 1);
    let earlier = &fact.history[0];
    assert_eq!(earlier.value, "Paris");
    assert_eq!(earlier.provenance, [0]);
    assert_eq!(earlier.ended_by, RevisionEnd::Replaced);
    assert_eq!(earlier.ended_at_turn, Some(11));
    assert_eq!(chat.state.turn_id(earlier.provenance[0]), Some("turn-0"));
    assert_eq!(
        chat.state
            .active_facts()
            .filter(|fact| fact.key == "lives in")
            .count(),
        1
    );

    let (_, prompt) = chat.ask("Any good bakeries near where I live?");
    let core = prompt[1].text();
    assert!(core.contains("- “lives in: Berlin”"), "{core}");
    assert!(!core.contains("lives in: Paris"), "{core}");
    // Stripping engram's blocks leaves only the client's own words.
    let stripped: Vec<String> = prompt
        .iter()
        .map(|message| strip_fences(&message.text()))
        .filter(|text| !text.is_empty())
        .collect();
    assert!(stripped.iter().all(|text| !text.contains("engram")));
}
