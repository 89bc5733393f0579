//! Deterministic, varied chat turns: sentence templates whose slots take words and numbers
//! picked by a generator seeded with the turn's index, so turn `n` is always the same text
//! and no two neighbouring turns read alike (the memory engine tokenises, indexes and
//! extracts facts from them).

const NAMES: [&str; 12] = [
    "Ana", "Rita", "Tomas", "Ines", "Bruno", "Marta", "Joao", "Sofia", "Pedro", "Clara", "Luis",
    "Helena",
];
const PLACES: [&str; 12] = [
    "Porto",
    "Lisbon",
    "Braga",
    "Coimbra",
    "Faro",
    "Aveiro",
    "Evora",
    "Sintra",
    "Madeira",
    "the Douro valley",
    "the Algarve coast",
    "the Serra da Estrela",
];
const THINGS: [&str; 16] = [
    "bicycle",
    "laptop",
    "kitchen sink",
    "garden fence",
    "car battery",
    "piano",
    "camera",
    "tent",
    "boiler",
    "bookshelf",
    "espresso machine",
    "running shoes",
    "winter coat",
    "balcony door",
    "printer",
    "sofa",
];
const TOPICS: [&str; 12] = [
    "tax return",
    "marathon training",
    "Spanish lessons",
    "kitchen renovation",
    "quarterly report",
    "school trip",
    "vegetable garden",
    "job interview",
    "wedding plans",
    "mortgage",
    "book club",
    "dentist visits",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const RELATIVES: [&str; 8] = [
    "sister",
    "brother",
    "mother",
    "father",
    "cousin",
    "daughter",
    "son",
    "neighbour",
];
const FOODS: [&str; 10] = [
    "grilled sardines",
    "lentil soup",
    "mushroom risotto",
    "chickpea curry",
    "baked cod",
    "pasta with pesto",
    "vegetable lasagne",
    "tofu stir fry",
    "caldo verde",
    "bean stew",
];

/// A small xorshift generator: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn seeded(seed: u64) -> Rng {
        // SplitMix64 of the seed, so consecutive seeds start far apart (and never at 0).
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn pick<'a>(&mut self, words: &[&'a str]) -> &'a str {
        words[self.below(words.len() as u64) as usize]
    }
}

/// Seeds the measured requests' messages (`user_text(REQUEST_SEED + n)`) apart from the
/// recorded turns' (`n`), so a request never repeats a turn of the history.
pub const REQUEST_SEED: u64 = 1 << 41;

/// Turn `n` as the proxy records it, in `session` under `turn_id`.
pub fn exchange(n: u64, session: &str, turn_id: String) -> engram_memory::ExchangeInput {
    engram_memory::ExchangeInput {
        session_id: session.to_owned(),
        turn_id,
        user_text: user_text(n),
        assistant_text: assistant_text(n),
        event_time: None,
        prior_chain: None,
        incomplete: false,
        arrival: None,
    }
}

/// The user message of turn `n` (about 60-140 bytes).
pub fn user_text(n: u64) -> String {
    let mut r = Rng::seeded(n);
    let template = r.below(12);
    let (a, b) = (r.below(90) + 2, r.below(900) + 10);
    match template {
        0 => format!(
            "On {} I ran {a} km around {} in {b} minutes, my best time this {}.",
            r.pick(&WEEKDAYS),
            r.pick(&PLACES),
            r.pick(&MONTHS)
        ),
        1 => format!(
            "My {} {} turns {a} on the {} of {}; remind me to order a {} for her.",
            r.pick(&RELATIVES),
            r.pick(&NAMES),
            r.below(28) + 1,
            r.pick(&MONTHS),
            r.pick(&THINGS)
        ),
        2 => format!(
            "The {} budget is now {b} euros after review number {a}, is that too much?",
            r.pick(&TOPICS)
        ),
        3 => format!(
            "I moved the {} repair to {}:{:02} on {} and it should cost about {b} euros.",
            r.pick(&THINGS),
            r.below(12) + 8,
            r.below(4) * 15,
            r.pick(&WEEKDAYS)
        ),
        4 => format!(
            "Can you compare {} and {} for a {a}-day trip in {}?",
            r.pick(&PLACES),
            r.pick(&PLACES),
            r.pick(&MONTHS)
        ),
        5 => format!(
            "I read {b} pages about my {} this week; chapter {a} was the useful one.",
            r.pick(&TOPICS)
        ),
        6 => format!(
            "{} from work said the {} deadline moved to the {} of {}.",
            r.pick(&NAMES),
            r.pick(&TOPICS),
            r.below(28) + 1,
            r.pick(&MONTHS)
        ),
        7 => format!(
            "I prefer {} over {}, and I cook for {} people on {}.",
            r.pick(&FOODS),
            r.pick(&FOODS),
            r.below(6) + 2,
            r.pick(&WEEKDAYS)
        ),
        8 => format!(
            "My {} broke again after {a} days; the shop in {} wants {b} euros to fix it.",
            r.pick(&THINGS),
            r.pick(&PLACES)
        ),
        9 => format!(
            "We are saving {b} euros a month for the {} and have {a} weeks left.",
            r.pick(&TOPICS)
        ),
        10 => format!(
            "I sleep about {} hours on weeknights and drink {} coffees before noon.",
            r.below(4) + 5,
            r.below(4) + 1
        ),
        _ => format!(
            "Note for later: {} owes me {b} euros for the {} tickets, due {}.",
            r.pick(&NAMES),
            r.pick(&PLACES),
            r.pick(&WEEKDAYS)
        ),
    }
}

/// The assistant's answer to turn `n` (about 100-200 bytes).
pub fn assistant_text(n: u64) -> String {
    let mut r = Rng::seeded(n ^ 0xA5A5_A5A5_5A5A_5A5A);
    let a = r.below(40) + 2;
    match r.below(4) {
        0 => format!(
            "Noted. Two suggestions: set aside {a} minutes on {} to plan it, and ask {} whether \
             the date still works. Do you want a reminder the day before?",
            r.pick(&WEEKDAYS),
            r.pick(&NAMES)
        ),
        1 => format!(
            "That sounds reasonable. Compared with last {}, it is about {a} percent more; I would \
             keep a small buffer just in case.",
            r.pick(&MONTHS)
        ),
        2 => format!(
            "Here is a short plan: start with {}, keep it under {a} minutes, and try {} on the \
             weekend. Anything you want to avoid?",
            r.pick(&FOODS),
            r.pick(&FOODS)
        ),
        _ => format!(
            "Got it. I will remember that for your {} and bring it up again around the {} of {}.",
            r.pick(&TOPICS),
            r.below(28) + 1,
            r.pick(&MONTHS)
        ),
    }
}
