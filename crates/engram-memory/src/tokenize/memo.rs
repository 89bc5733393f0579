//! A per-thread memo of pure functions of a text. The worker derives the same things from the
//! same texts on every turn (the terms of each working-set item when it touches related items,
//! the words of an episode's turns when it rebuilds the manifest); remembering them by text
//! keeps that work from growing with the working set. A hit is checked against the whole text,
//! so a memo never changes an answer, only how often it is computed.

use std::cell::RefCell;
use std::hash::BuildHasher;
use std::rc::Rc;
use std::thread::LocalKey;

use rustc_hash::FxHashMap;

/// Texts remembered per generation; two generations are kept, so the most recent 256 to 512
/// distinct texts hit: a working set and the episodes a turn looks at are fewer, and each of
/// the worker's blocking threads keeps its own memos.
pub const DEFAULT_GENERATION: usize = 256;

/// Two generations of `GENERATION` texts each: a hit in the older one moves to the newer one;
/// when the newer one fills, the older one is dropped. Roughly least-recently-used, with no
/// per-hit bookkeeping.
pub struct TextMemo<T, const GENERATION: usize = DEFAULT_GENERATION> {
    current: FxHashMap<u64, (Box<str>, Rc<T>)>,
    previous: FxHashMap<u64, (Box<str>, Rc<T>)>,
}

impl<T, const GENERATION: usize> Default for TextMemo<T, GENERATION> {
    fn default() -> Self {
        TextMemo {
            current: FxHashMap::default(),
            previous: FxHashMap::default(),
        }
    }
}

impl<T, const GENERATION: usize> TextMemo<T, GENERATION> {
    /// `compute()`, or what it gave before for this same `text` (a text, or a key that names
    /// everything `compute` reads).
    pub fn get(&mut self, text: &str, compute: impl FnOnce() -> T) -> Rc<T> {
        let key = fingerprint(text);
        if let Some((seen, value)) = self.current.get(&key)
            && **seen == *text
        {
            return Rc::clone(value);
        }
        let value = match self.previous.remove(&key) {
            Some((seen, value)) if *seen == *text => value,
            _ => Rc::new(compute()),
        };
        if self.current.len() >= GENERATION {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current
            .insert(key, (Box::from(text), Rc::clone(&value)));
        value
    }

    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// [`TextMemo::get`] on this thread's memo `memo`.
pub fn memoised<T: 'static, const GENERATION: usize>(
    memo: &'static LocalKey<RefCell<TextMemo<T, GENERATION>>>,
    text: &str,
    compute: impl FnOnce() -> T,
) -> Rc<T> {
    memo.with_borrow_mut(|memo| memo.get(text, compute))
}

fn fingerprint(text: &str) -> u64 {
    rustc_hash::FxBuildHasher.hash_one(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn a_text_is_computed_once_and_answers_stay_exact() {
        let mut memo: TextMemo<String> = TextMemo::default();
        let calls = Cell::new(0);
        let upper = |text: &str| {
            calls.set(calls.get() + 1);
            text.to_uppercase()
        };
        let mut get = |text: &str| memo.get(text, || upper(text));
        assert_eq!(*get("hiking in Porto"), "HIKING IN PORTO");
        assert_eq!(*get("hiking in Porto"), "HIKING IN PORTO");
        assert_eq!(calls.get(), 1);
        assert_eq!(*get("hiking in Lisbon"), "HIKING IN LISBON");
        assert_eq!(calls.get(), 2);
    }

    #[test]
    fn generations_bound_the_memo_and_recent_texts_survive() {
        let mut memo: TextMemo<usize> = TextMemo::default();
        let calls = Cell::new(0);
        let length = |text: &str| {
            calls.set(calls.get() + 1);
            text.len()
        };
        const GENERATION: usize = DEFAULT_GENERATION;
        for n in 0..GENERATION * 5 {
            let text = format!("text {n}");
            memo.get(&text, || length(&text));
            // The text before this one is still remembered.
            if n > 0 {
                let before = calls.get();
                let text = format!("text {}", n - 1);
                memo.get(&text, || length(&text));
                assert_eq!(calls.get(), before, "text {} was forgotten", n - 1);
            }
        }
        assert!(memo.len() <= 2 * GENERATION, "{} texts kept", memo.len());
    }
}
