//! engram-ops: operating the sidecar.
//!
//! The Prometheus registry (it names, registers and builds every metric handle the proxy counts
//! into) and the store's timing decorator; the configuration that gathers each module's
//! section; the command line; the management API and its client; the OTLP exporter behind the
//! proxy's tracing handle (`telemetry`). It stands on `engram-proxy`
//! and the crates below it; the binary (`engram`) stands on it; docs/architecture.md has the
//! map.

// The one error type of the sidecar, the runtime crate's: `crate::error` in this crate.
use engram_runtime::error;

pub mod admin;
pub mod cli;
pub mod config;
pub mod metrics;
pub mod telemetry;
