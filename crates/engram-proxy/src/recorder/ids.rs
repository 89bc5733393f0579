//! The ids of recorded turns: turn ids made by this proxy (which tell when their request
//! arrived) and job keys (a hash of what identifies the exchange).

use std::sync::atomic::{AtomicU64, Ordering};

use engram_runtime::now_micros;
use engram_store::UserKey;

/// The job key of an exchange: a hash of what identifies it (tenant, user, session, turn id),
/// so recording the same exchange twice queues one job.
pub fn job_key(user: &UserKey, session: &str, turn_id: &str) -> String {
    let fields = [user.tenant.as_str(), user.user.as_str(), session, turn_id];
    let mut high = FNV_OFFSET;
    let mut low = FNV_OFFSET ^ 0x9e37_79b9_7f4a_7c15;
    for field in fields {
        // Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
        for bytes in [&(field.len() as u64).to_le_bytes()[..], field.as_bytes()] {
            high = fnv1a(high, bytes);
            low = fnv1a(low, bytes);
        }
        low = low.rotate_left(17);
    }
    format!("{high:016x}{low:016x}")
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// Turn ids unique across processes and restarts: the time the id was made, a per-process
/// nonce and a counter (`t<micros>-<nonce>-<n>`), all in hex. The time tells the worker's job
/// lag metric when the request arrived (see [`turn_time_micros`]).
pub struct TurnIds {
    nonce: u32,
    counter: AtomicU64,
}

impl Default for TurnIds {
    fn default() -> TurnIds {
        TurnIds::new()
    }
}

impl TurnIds {
    pub fn new() -> TurnIds {
        let started = now_micros();
        let nonce = fnv1a(
            FNV_OFFSET,
            format!("{}:{started}", std::process::id()).as_bytes(),
        );
        TurnIds {
            nonce: (nonce >> 32) as u32 ^ nonce as u32,
            counter: AtomicU64::new(0),
        }
    }

    pub fn next(&self) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        format!("t{:x}-{:08x}-{n:x}", now_micros(), self.nonce)
    }
}

/// When a turn id made by this proxy was made (its request's arrival), in microseconds since
/// the Unix epoch; `None` for any other id.
pub fn turn_time_micros(turn_id: &str) -> Option<u64> {
    let (micros, _) = turn_id.strip_prefix('t')?.split_once('-')?;
    u64::from_str_radix(micros, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_id_tells_when_it_was_made() {
        let before = now_micros();
        let id = TurnIds::new().next();
        let after = now_micros();
        let made = turn_time_micros(&id).unwrap();
        assert!(before <= made && made <= after, "{id}");
        assert_eq!(turn_time_micros("turn-1"), None);
        assert_eq!(turn_time_micros("t-1"), None);
    }

    #[test]
    fn job_keys_depend_on_every_field_and_their_boundaries() {
        let user = UserKey::new("t", "u");
        let base = job_key(&user, "s", "turn");
        assert_eq!(base, job_key(&user, "s", "turn"));
        assert_eq!(base.len(), 32);
        assert_ne!(base, job_key(&UserKey::new("t2", "u"), "s", "turn"));
        assert_ne!(base, job_key(&UserKey::new("t", "u2"), "s", "turn"));
        assert_ne!(base, job_key(&user, "s2", "turn"));
        assert_ne!(base, job_key(&user, "s", "turn2"));
        assert_ne!(
            job_key(&UserKey::new("ab", "c"), "s", "t"),
            job_key(&UserKey::new("a", "bc"), "s", "t")
        );
    }

    #[test]
    fn turn_ids_do_not_repeat() {
        let ids = TurnIds::new();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1000 {
            assert!(seen.insert(ids.next()));
        }
    }
}
