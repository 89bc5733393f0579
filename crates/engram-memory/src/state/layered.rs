//! A map kept as immutable layers shared between copies, plus a small mutable head (an LSM
//! tree in memory).
//!
//! The lookups a user's memory keeps (the index's vocabulary, chain links, turn ids) grow with
//! the history, and every turn's copy of the memory needs them. Cloning a [`LayeredMap`] copies
//! the head (at most [`HEAD`] entries) and one pointer per layer; an insert goes into the head,
//! a full head is sealed into a layer, and layers of similar size are merged, so a map of `n`
//! entries has about `log2(n / HEAD)` layers and each entry is copied `O(log n)` times over its
//! life. A newer layer's entry shadows an older one's.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::Arc;

/// Entries the mutable head holds before it is sealed.
pub const HEAD: usize = 256;

#[derive(Clone)]
pub struct LayeredMap<K, V, S> {
    /// Oldest first; each a sealed head or a merge of sealed heads.
    layers: Vec<Arc<HashMap<K, V, S>>>,
    head: HashMap<K, V, S>,
}

impl<K, V, S> std::fmt::Debug for LayeredMap<K, V, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayeredMap")
            .field("layers", &self.layers.len())
            .field("head", &self.head.len())
            .finish()
    }
}

impl<K, V, S: Default> Default for LayeredMap<K, V, S> {
    fn default() -> Self {
        LayeredMap {
            layers: Vec::new(),
            head: HashMap::default(),
        }
    }
}

impl<K, V, S> LayeredMap<K, V, S>
where
    K: Hash + Eq + Clone,
    V: Clone,
    S: BuildHasher + Default + Clone,
{
    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.head
            .get(key)
            .or_else(|| self.layers.iter().rev().find_map(|layer| layer.get(key)))
    }

    pub fn insert(&mut self, key: K, value: V) {
        self.head.insert(key, value);
        if self.head.len() >= HEAD {
            self.seal();
        }
    }

    /// Layers searched by a miss; for tests and sizing.
    pub fn depth(&self) -> usize {
        self.layers.len() + 1
    }

    /// Entries stored, counting shadowed ones.
    pub fn stored(&self) -> usize {
        self.head.len() + self.layers.iter().map(|layer| layer.len()).sum::<usize>()
    }

    /// Every live key with its value, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> + '_ {
        let head = self.head.iter();
        let layers = self.layers.iter().enumerate().flat_map(move |(at, layer)| {
            layer.iter().filter(move |(key, _)| {
                !self.head.contains_key(*key)
                    && !self.layers[at + 1..]
                        .iter()
                        .any(|newer| newer.contains_key(*key))
            })
        });
        head.chain(layers)
    }

    fn seal(&mut self) {
        let sealed = std::mem::take(&mut self.head);
        self.layers.push(Arc::new(sealed));
        // Merge while the newest layer has grown to at least half its older neighbour.
        while let [.., older, newer] = self.layers.as_slice()
            && newer.len() * 2 >= older.len()
        {
            let (Some(newer), Some(older)) = (self.layers.pop(), self.layers.pop()) else {
                break;
            };
            let mut merged = Arc::unwrap_or_clone(older);
            merged.reserve(newer.len());
            for (key, value) in newer.iter() {
                merged.insert(key.clone(), value.clone());
            }
            self.layers.push(Arc::new(merged));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustc_hash::FxBuildHasher;

    #[test]
    fn newer_values_shadow_older_ones_across_layers() {
        let mut map: LayeredMap<u64, u64, FxBuildHasher> = LayeredMap::default();
        for key in 0..10_000 {
            map.insert(key, key);
        }
        for key in (0..10_000).step_by(7) {
            map.insert(key, key + 1);
        }
        for key in 0..10_000 {
            let expected = if key % 7 == 0 { key + 1 } else { key };
            assert_eq!(map.get(&key), Some(&expected), "{key}");
        }
        assert_eq!(map.get(&10_000), None);
        // Layers stay logarithmic in the entries.
        assert!(map.depth() <= 12, "{}", map.depth());
        let mut live: Vec<u64> = map.iter().map(|(key, _)| *key).collect();
        live.sort_unstable();
        assert_eq!(live, (0..10_000).collect::<Vec<_>>());
    }

    #[test]
    fn a_clone_shares_sealed_layers() {
        let mut map: LayeredMap<u64, String, FxBuildHasher> = LayeredMap::default();
        for key in 0..(HEAD as u64 * 4) {
            map.insert(key, key.to_string());
        }
        let copy = map.clone();
        map.insert(1, "one".into());
        assert_eq!(copy.get(&1).map(String::as_str), Some("1"));
        assert_eq!(map.get(&1).map(String::as_str), Some("one"));
        assert!(Arc::ptr_eq(&map.layers[0], &copy.layers[0]));
    }
}
