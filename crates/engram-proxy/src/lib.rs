//! engram-proxy: the sidecar's proxy, everything a request and its recording go through.
//!
//! The upstream client, OpenTelemetry spans and W3C propagation, the cache of decoded memories,
//! credentials, rate limits, the summarizer, the recorder, the hot path's rewrite (`pipeline`)
//! and the worker that applies jobs. It stands on `engram-store`, `engram-runtime` and
//! `engram-memory`; operations (`engram-ops`) and the binary (`engram`) stand on it;
//! docs/architecture.md has the map.

// The one error type of the sidecar, the runtime crate's: `crate::error` in this crate.
use engram_runtime::error;

pub mod cache;
pub mod credentials;
pub mod pipeline;
pub mod ratelimit;
pub mod recorder;
pub mod summarizer;
pub mod telemetry;
#[cfg(test)]
mod test_store;
pub mod upstream;
pub mod worker;
