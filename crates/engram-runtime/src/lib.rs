//! What every layer of the sidecar stands on, at the bottom of its crates (above the engine):
//! the one error type ([`error`], OpenAI-shaped bodies), the boxed future of the object-safe
//! traits (the store's), the process clock, and the runtimes and thread priorities of the
//! update path ([`priority`]). The sidecar names the error type `engram::error`.

use std::future::Future;
use std::pin::Pin;

pub mod error;
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
