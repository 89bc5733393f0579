//! A throwaway `redis-server` for benchmarks: a free loopback port, no persistence.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Starts `redis-server` through `launcher` (e.g. `taskset -c 0`, or nothing); `None` if it is
/// not installed or does not come up.
pub fn start_redis(launcher: &[&str]) -> Option<(Child, u16)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let mut command = match launcher.split_first() {
        Some((program, args)) => {
            let mut command = Command::new(program);
            command.args(args).arg("redis-server");
            command
        }
        None => Command::new("redis-server"),
    };
    let child = command
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    for _ in 0..200 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Some((child, port));
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    None
}
