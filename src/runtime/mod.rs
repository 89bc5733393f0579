//! What every layer may use, at the bottom of the import order: the boxed future of the
//! object-safe traits (the store, the memory layer), the process clock, and the thread
//! priorities of the update path ([`priority`]). It imports nothing from the crate but its error.

use std::future::Future;
use std::pin::Pin;

pub mod priority;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The current time in microseconds since the Unix epoch: when a turn's request arrived, the
/// start of a new memory's versions (`cache::first_version`), the job lag metric's clock.
pub fn now_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |elapsed| {
            u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX / 2)
        })
}
