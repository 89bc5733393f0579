//! Deterministic text that reads like prose to the memory engine, for benchmarks.

/// `len` bytes of ASCII that read like prose to the memory engine (which tokenises, indexes
/// and extracts from it): sentences of words drawn with a Zipf-like skew from a 4,096-word
/// vocabulary whose most frequent words are English function words, as in real text.
/// Deterministic, so every system gets the same bodies.
pub fn prose(len: usize) -> String {
    const COMMON: [&str; 24] = [
        "the", "of", "and", "to", "a", "in", "is", "it", "that", "for", "was", "on", "with", "as",
        "he", "be", "at", "by", "this", "had", "not", "are", "but", "from",
    ];
    const SYLLABLES: [&str; 16] = [
        "ka", "lo", "mi", "ren", "sta", "vo", "th", "ul", "pe", "dri", "an", "so", "gel", "mar",
        "tu", "ix",
    ];
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut out = String::with_capacity(len + 32);
    let mut words_in_sentence = 0;
    while out.len() < len {
        // rank = 4096^u - 1 for uniform u: frequency falls off as 1/rank.
        let u = (next() >> 11) as f64 / (1u64 << 53) as f64;
        let rank = (4096f64.powf(u) as usize).saturating_sub(1).min(4095);
        match COMMON.get(rank) {
            Some(word) => out.push_str(word),
            None => {
                for shift in [0, 4, 8] {
                    out.push_str(SYLLABLES[(rank >> shift) & 15]);
                }
            }
        }
        words_in_sentence += 1;
        if words_in_sentence >= 10 + (next() % 10) {
            out.push_str(". ");
            words_in_sentence = 0;
        } else {
            out.push(' ');
        }
    }
    out.truncate(len);
    out
}
