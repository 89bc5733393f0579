//! The `engram-mock` binary: an OpenAI-compatible mock upstream (see the library's docs).

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use engram_mock::MockArgs;

fn main() -> ExitCode {
    let args = MockArgs::parse();
    engram_mock::init_logging();
    match args.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let _ = writeln!(std::io::stderr(), "engram-mock: {error}");
            ExitCode::FAILURE
        }
    }
}
