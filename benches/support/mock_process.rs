//! The benchmarks' mock upstream, a process of its own as before: the bench binary starts
//! itself with `mock-upstream` as its first argument and serves `engram-mock` from the library
//! it links. (`engram-mock` is a crate of its own, outside the sidecar, and cargo gives a
//! bench the path of its own package's binaries only.)

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;

/// The first argument that makes a bench binary the mock; the mock's options follow it.
pub const ARG: &str = "mock-upstream";

/// First thing in a bench's `main`: when this process was started as the mock, serves it
/// until SIGINT or SIGTERM and exits.
pub fn serve_if_asked() {
    use clap::Parser;
    let mut args = std::env::args_os();
    let program = args.next().unwrap_or_default();
    if args.next().as_deref() != Some(ARG.as_ref()) {
        return;
    }
    let args = engram_mock::MockArgs::parse_from(std::iter::once(program).chain(args));
    engram_mock::init_logging();
    let code = match args.run() {
        Ok(()) => 0,
        Err(error) => {
            let _ = writeln!(std::io::stderr(), "engram-mock: {error}");
            1
        }
    };
    std::process::exit(code);
}

/// The program to run for `args`: this bench binary for the mock (`args` starting with
/// [`ARG`]), `engram` otherwise.
pub fn program(args: &[&str], engram: &str) -> OsString {
    if args.first() == Some(&ARG) {
        std::env::current_exe()
            .unwrap_or_else(|_| PathBuf::from(std::env::args_os().next().unwrap_or_default()))
            .into_os_string()
    } else {
        engram.into()
    }
}
