//! Memory quality, measured: `engram-eval locomo` replays the LoCoMo conversations through the
//! proxy (in-process or running), asks their questions read-only, and compares the prompts the
//! upstream received with baselines built from the same data (see `docs/evaluation.md`).
//!
//! - `dataset`: LoCoMo's JSON → sessions of exchanges and questions with resolved evidence;
//! - `upstream`: the scripted upstream (replies verbatim, records prompts);
//! - `client`: the harness's HTTP client for the proxy and its management API;
//! - `locomo`: the replay protocol and the probes;
//! - `metrics`, `baselines`, `bm25`: the figures and what engram is compared with;
//! - `report`, `chart`, `progress`: markdown, JSON, SVG and the progress bar;
//! - `cli`: the command line of the `engram-eval` binary.

pub mod baselines;
pub mod bm25;
pub mod chart;
pub mod cli;
pub mod client;
pub mod dataset;
pub mod locomo;
pub mod metrics;
pub mod progress;
pub mod report;
pub mod upstream;
