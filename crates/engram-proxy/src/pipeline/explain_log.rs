//! The explanations of recent turns (what was injected, from which tier, with what score, how
//! many tokens, why), kept in this process for the management API's explain route. Bounded:
//! the oldest go first. A turn served by another replica is not here.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use engram_memory::Explain;
use engram_store::UserKey;

type TurnKey = (UserKey, String);

#[derive(Debug)]
pub struct ExplainLog {
    inner: Mutex<Inner>,
    capacity: usize,
}

#[derive(Debug, Default)]
struct Inner {
    explains: HashMap<TurnKey, Arc<Explain>>,
    order: VecDeque<TurnKey>,
}

impl ExplainLog {
    pub fn new(capacity: usize) -> ExplainLog {
        ExplainLog {
            inner: Mutex::new(Inner::default()),
            capacity: capacity.max(1),
        }
    }

    /// How many turns' explanations it keeps.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn put(&self, user: &UserKey, turn_id: &str, explain: Explain) {
        let key = (user.clone(), turn_id.to_owned());
        let mut dropped = Vec::new();
        {
            let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
            if inner
                .explains
                .insert(key.clone(), Arc::new(explain))
                .is_none()
            {
                inner.order.push_back(key);
            }
            while inner.order.len() > self.capacity {
                if let Some(old) = inner.order.pop_front() {
                    dropped.extend(inner.explains.remove(&old));
                }
            }
        }
        drop(dropped);
    }

    /// Drops every explanation of the user's turns (forget); returns how many there were.
    pub fn forget(&self, user: &UserKey) -> usize {
        let mut dropped = Vec::new();
        {
            let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
            inner.order.retain(|(owner, _)| owner != user);
            let keys: Vec<TurnKey> = inner
                .explains
                .keys()
                .filter(|(owner, _)| owner == user)
                .cloned()
                .collect();
            for key in keys {
                dropped.extend(inner.explains.remove(&key));
            }
        }
        dropped.len()
    }

    pub fn get(&self, user: &UserKey, turn_id: &str) -> Option<Arc<Explain>> {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner
            .explains
            .get(&(user.clone(), turn_id.to_owned()))
            .cloned()
    }
}
