//! A vector stored as fixed-size chunks shared between copies, with a record of what changed.
//!
//! A user's memory grows with every turn, and both the worker (which changes it) and the hot
//! path (which reads a published copy) hold one. Cloning a [`Segmented`] copies one pointer per
//! chunk, not the items; changing an item copies only its chunk, and only when another copy
//! still shares it. Every change also notes the item's position, so a store writes exactly the
//! items a turn touched ([`Segmented::take_dirty`]) instead of the whole memory.
//!
//! Serialised as a plain sequence, so a memory stored as one value decodes into it unchanged.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};
use serde::ser::{Serialize, SerializeSeq, Serializer};

/// Items per chunk: a change copies at most this many items.
pub const CHUNK: usize = 64;

#[derive(Debug, Clone)]
pub struct Segmented<T> {
    chunks: Vec<Arc<Vec<T>>>,
    len: usize,
    /// Positions changed or appended since the last `take_dirty`, in the order they changed
    /// (repeats allowed; `take_dirty` sorts them).
    dirty: Vec<u32>,
}

impl<T> Default for Segmented<T> {
    fn default() -> Self {
        Segmented {
            chunks: Vec::new(),
            len: 0,
            dirty: Vec::new(),
        }
    }
}

impl<T: Clone> Segmented<T> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, index: usize) -> Option<&T> {
        self.chunks.get(index / CHUNK)?.get(index % CHUNK)
    }

    pub fn last(&self) -> Option<&T> {
        self.len.checked_sub(1).and_then(|last| self.get(last))
    }

    /// The item at `index` for changing: its chunk is copied first if another copy shares it,
    /// and the position is noted as changed.
    pub fn get_mut(&mut self, index: usize) -> Option<&mut T> {
        if index >= self.len {
            return None;
        }
        self.note(index);
        let chunk = self.chunks.get_mut(index / CHUNK)?;
        owned(chunk).get_mut(index % CHUNK)
    }

    pub fn push(&mut self, item: T) {
        let index = self.len;
        match self.chunks.last_mut() {
            Some(chunk) if chunk.len() < CHUNK => {
                let chunk = owned(chunk);
                if chunk.len() == chunk.capacity() {
                    chunk.reserve_exact(room(chunk.len()) - chunk.len());
                }
                chunk.push(item);
            }
            _ => {
                let mut chunk = Vec::with_capacity(CHUNK);
                chunk.push(item);
                self.chunks.push(Arc::new(chunk));
            }
        }
        self.len += 1;
        self.note(index);
    }

    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &T> + '_ {
        self.chunks.iter().flat_map(|chunk| chunk.iter())
    }

    /// The items from position `start` on, with their positions; the ones before are not
    /// walked.
    pub fn iter_from(&self, start: usize) -> impl Iterator<Item = (usize, &T)> + '_ {
        self.chunks
            .iter()
            .enumerate()
            .skip(start / CHUNK)
            .flat_map(|(chunk_at, chunk)| {
                chunk
                    .iter()
                    .enumerate()
                    .map(move |(at, item)| (chunk_at * CHUNK + at, item))
            })
            .skip(start % CHUNK)
    }

    /// Every item for changing: copies every shared chunk and notes every position. For bulk
    /// edits (a management deletion), never for a turn's work.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> + '_ {
        self.dirty
            .extend(0..u32::try_from(self.len).unwrap_or(u32::MAX));
        self.chunks
            .iter_mut()
            .flat_map(|chunk| owned(chunk).iter_mut())
    }

    /// Positions changed since the last call, ascending and distinct; the record starts over.
    pub fn take_dirty(&mut self) -> Vec<u32> {
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.sort_unstable();
        dirty.dedup();
        dirty
    }

    /// Positions changed since the last `take_dirty`, in the order they changed, with repeats.
    pub fn pending(&self) -> &[u32] {
        &self.dirty
    }

    /// Whether anything changed since the last `take_dirty`.
    pub fn has_changes(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// Sets the item at `index` without noting a change: a loader placing stored items.
    /// Appends when `index == len`; false when `index` is past the end.
    pub fn put_clean(&mut self, index: usize, item: T) -> bool {
        if index == self.len {
            self.push(item);
            self.dirty.pop();
            return true;
        }
        match self.get_mut(index) {
            Some(slot) => {
                *slot = item;
                self.dirty.pop();
                true
            }
            None => false,
        }
    }

    /// How many chunks another copy no longer shares with this one; for tests and sizing.
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// The positions both copies hold whose chunk this copy no longer shares with `other`:
    /// where their items may differ.
    pub fn unshared_positions<'a>(
        &'a self,
        other: &'a Segmented<T>,
    ) -> impl Iterator<Item = usize> + 'a {
        let len = self.len.min(other.len);
        self.chunks
            .iter()
            .zip(&other.chunks)
            .enumerate()
            .filter(|(_, (mine, theirs))| !Arc::ptr_eq(mine, theirs))
            .flat_map(move |(at, _)| at * CHUNK..((at + 1) * CHUNK).min(len))
    }

    /// Whether this copy and `other` share the chunk holding `index` (no copy was made).
    pub fn shares_chunk_with(&self, other: &Segmented<T>, index: usize) -> bool {
        match (
            self.chunks.get(index / CHUNK),
            other.chunks.get(index / CHUNK),
        ) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    fn note(&mut self, index: usize) {
        self.dirty.push(u32::try_from(index).unwrap_or(u32::MAX));
    }
}

impl<T: Clone> std::ops::Index<usize> for Segmented<T> {
    type Output = T;

    fn index(&self, index: usize) -> &T {
        match self.get(index) {
            Some(item) => item,
            None => out_of_bounds(index, self.len),
        }
    }
}

impl<T: Clone> std::ops::IndexMut<usize> for Segmented<T> {
    fn index_mut(&mut self, index: usize) -> &mut T {
        let len = self.len;
        match self.get_mut(index) {
            Some(item) => item,
            None => out_of_bounds(index, len),
        }
    }
}

/// `chunk` for changing, copied first if another copy of the memory shares it. The copy has
/// room to grow, up to one chunk and never past it: `Arc::make_mut` would copy it at its
/// length, so the next push doubled it, and a chunk filled one turn at a time (each turn a new
/// copy of the memory) kept room for 126 items, nearly twice what it holds, for as long as the
/// memory lived. A small memory's chunks stay small (many users' memories are).
fn owned<T: Clone>(chunk: &mut Arc<Vec<T>>) -> &mut Vec<T> {
    if Arc::get_mut(chunk).is_none() {
        let mut copy = Vec::with_capacity(room(chunk.len()));
        copy.extend(chunk.iter().cloned());
        *chunk = Arc::new(copy);
    }
    // Not shared any more: no second copy.
    Arc::make_mut(chunk)
}

/// The room a chunk of `len` items gets when it is copied or full: doubling, as a vector grows,
/// but never past one chunk (`len` is at most a chunk, so the room holds it, and one more item
/// when it is short of a chunk).
fn room(len: usize) -> usize {
    (len * 2).clamp(4, CHUNK)
}

#[expect(
    clippy::panic,
    reason = "indexing past the end is a bug, as it is for a Vec; callers use `get` on input"
)]
fn out_of_bounds(index: usize, len: usize) -> ! {
    panic!("index {index} out of bounds for a memory vector of {len} items")
}

impl<T: PartialEq + Clone> PartialEq for Segmented<T> {
    /// Equal items in equal order; the change record does not count.
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl<T: Clone> FromIterator<T> for Segmented<T> {
    fn from_iter<I: IntoIterator<Item = T>>(items: I) -> Self {
        let mut segmented = Segmented::new();
        for item in items {
            segmented.push(item);
        }
        segmented.dirty.clear();
        segmented
    }
}

impl<T: Clone> From<Vec<T>> for Segmented<T> {
    fn from(items: Vec<T>) -> Self {
        items.into_iter().collect()
    }
}

impl<'a, T: Clone> IntoIterator for &'a Segmented<T> {
    type Item = &'a T;
    type IntoIter = Box<dyn DoubleEndedIterator<Item = &'a T> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

impl<T: Serialize + Clone> Serialize for Segmented<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.len))?;
        for item in self.iter() {
            seq.serialize_element(item)?;
        }
        seq.end()
    }
}

impl<'de, T: Deserialize<'de> + Clone> Deserialize<'de> for Segmented<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Vec::<T>::deserialize(deserializer).map(Segmented::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_like_a_vector_across_chunks() {
        let items: Vec<u32> = (0..200).collect();
        let segmented: Segmented<u32> = items.iter().copied().collect();
        assert_eq!(segmented.len(), 200);
        assert_eq!(segmented.chunk_count(), 200usize.div_ceil(CHUNK));
        assert!(segmented.iter().copied().eq(items.iter().copied()));
        assert_eq!(segmented[130], 130);
        assert_eq!(segmented.get(200), None);
        assert_eq!(segmented.last(), Some(&199));
        for start in [0, 1, 63, 64, 65, 130, 199, 200, 500] {
            let from: Vec<(usize, u32)> =
                segmented.iter_from(start).map(|(at, n)| (at, *n)).collect();
            let expected: Vec<(usize, u32)> =
                (start.min(200)..200).map(|n| (n, n as u32)).collect();
            assert_eq!(from, expected, "from {start}");
        }
        assert_eq!(segmented.iter().next_back(), Some(&199));
    }

    #[test]
    fn a_clone_shares_chunks_until_one_of_them_changes() {
        let mut original: Segmented<String> = (0..130).map(|n| n.to_string()).collect();
        let copy = original.clone();
        assert!(original.shares_chunk_with(&copy, 0));
        original[70] = "changed".into();
        // Only the changed item's chunk was copied.
        assert!(!original.shares_chunk_with(&copy, 70));
        assert!(original.shares_chunk_with(&copy, 0));
        assert!(original.shares_chunk_with(&copy, 129));
        assert_eq!(copy[70], "70");
        assert_eq!(original[70], "changed");
    }

    #[test]
    fn a_chunk_filled_one_copy_at_a_time_keeps_one_chunks_room() {
        // As the worker grows a memory: each turn changes a new copy while the cache (and
        // readers) still hold the previous one.
        let mut memory: Segmented<u64> = Segmented::new();
        let mut previous = Vec::new();
        for n in 0..(3 * CHUNK as u64 + 5) {
            let mut next = memory.clone();
            next.push(n);
            if n % 7 == 0 {
                next[n as usize / 2] += 1;
            }
            previous.push(memory);
            memory = next;
        }
        let room: Vec<usize> = memory.chunks.iter().map(|chunk| chunk.capacity()).collect();
        assert_eq!(room[..3], [CHUNK; 3], "full chunks' room for items");
        // The last holds 5 items, in room for at most twice what it held when copied.
        assert!((5..=8).contains(&room[3]), "{room:?}");
        assert_eq!(memory.len(), 3 * CHUNK + 5);
        assert_eq!(memory[3 * CHUNK + 4], 3 * CHUNK as u64 + 4);
        // A run of turns recorded on one copy grows its chunk in place, to one chunk at most.
        let mut run = memory.clone();
        for n in 0..(2 * CHUNK as u64) {
            run.push(n);
        }
        assert!(run.chunks.iter().all(|chunk| chunk.capacity() <= CHUNK));
        // Older copies are unchanged.
        assert_eq!(previous[10].len(), 10);
        assert_eq!(previous[10][9], 9);
        assert_eq!(previous[100].len(), 100);
    }

    #[test]
    fn unshared_positions_are_those_of_the_chunks_a_copy_changed() {
        let original: Segmented<u32> = (0..200).collect();
        let mut copy = original.clone();
        assert_eq!(copy.unshared_positions(&original).count(), 0);
        copy[70] += 1;
        copy.push(200);
        let unshared: Vec<usize> = copy.unshared_positions(&original).collect();
        let expected: Vec<usize> = (64..128).chain(192..200).collect();
        assert_eq!(unshared, expected);
    }

    #[test]
    fn a_small_memorys_copies_stay_small() {
        let mut memory: Segmented<u64> = (0..3).collect();
        for n in 3..6 {
            let mut next = memory.clone();
            next.push(n);
            memory = next;
        }
        let room = memory.chunks.first().map(|chunk| chunk.capacity());
        assert!(room.is_some_and(|room| room <= 10), "{room:?}");
    }

    #[test]
    fn changes_and_appends_are_recorded_once_each() {
        let mut segmented: Segmented<u32> = (0..10).collect();
        assert!(!segmented.has_changes());
        segmented[3] += 1;
        if let Some(item) = segmented.get_mut(3) {
            *item += 1;
        }
        segmented.push(10);
        assert!(segmented.get_mut(99).is_none());
        assert_eq!(segmented.take_dirty(), vec![3, 10]);
        assert!(segmented.take_dirty().is_empty());
        assert!(segmented.put_clean(11, 11));
        assert!(segmented.put_clean(0, 7));
        assert!(!segmented.put_clean(40, 1));
        assert!(!segmented.has_changes());
        assert_eq!(segmented[0], 7);
    }

    #[test]
    fn serialises_as_a_plain_sequence() {
        let segmented: Segmented<u32> = (0..70).collect();
        let json = serde_json::to_string(&segmented).unwrap();
        let plain: Vec<u32> = serde_json::from_str(&json).unwrap();
        assert_eq!(plain, (0..70).collect::<Vec<_>>());
        let back: Segmented<u32> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, segmented);
        assert!(!back.has_changes());
    }
}
