//! A real `redis-server` for tests: on a free loopback port, killed on drop. Without
//! `redis-server` on PATH, tests skip (say so and return `None`), unless
//! `ENGRAM_REQUIRE_REDIS=1` (set by `scripts/test.sh`, so CI never skips silently).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    /// With a directory the server keeps an append-only file there (fsync on every write), so
    /// a restart on the same port finds everything it acknowledged.
    dir: Option<PathBuf>,
    /// The port of the server this one replicates.
    replica_of: Option<u16>,
    /// The working directory of a throwaway server: a replica writes the data it syncs there,
    /// and a server reads what it finds there at start, so it must not be the crate's.
    scratch: tempfile::TempDir,
}

impl RedisServer {
    /// A throwaway server without persistence.
    pub async fn start() -> Option<RedisServer> {
        RedisServer::spawn(None, None).await
    }

    /// A server that persists to `dir` and can be killed and restarted.
    pub async fn start_durable(dir: &Path) -> Option<RedisServer> {
        RedisServer::spawn(Some(dir.to_owned()), None).await
    }

    /// A throwaway replica of the server on `port`.
    pub async fn start_replica_of(port: u16) -> Option<RedisServer> {
        RedisServer::spawn(None, Some(port)).await
    }

    async fn spawn(dir: Option<PathBuf>, replica_of: Option<u16>) -> Option<RedisServer> {
        if !installed() {
            if std::env::var("ENGRAM_REQUIRE_REDIS").is_ok_and(|value| value == "1") {
                panic!(
                    "ENGRAM_REQUIRE_REDIS=1 but redis-server is not on PATH; install redis-server"
                );
            }
            println!("SKIPPED: redis-server not installed");
            return None;
        }
        let mut server = RedisServer {
            child: None,
            port: free_port(),
            dir,
            replica_of,
            scratch: tempfile::tempdir().unwrap(),
        };
        // Many test processes pick free ports at once: if another took ours first, take a new
        // one rather than talk to someone else's server.
        for _ in 0..5 {
            if server.try_start().await {
                return Some(server);
            }
            server.port = free_port();
        }
        panic!("redis-server did not start on a free port in five tries");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL): nothing is flushed beyond what it already acknowledged.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open and commands hang, like a server
    /// stalled by a long command or a swapping host.
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// Lets a paused server run again (SIGCONT); it then answers what queued up meanwhile.
    pub fn resume(&self) {
        self.signal("CONT");
    }

    fn signal(&self, name: &str) {
        let child = self.child.as_ref().expect("redis-server is not running");
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(child.id().to_string())
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Starts the server (again) on its port and waits until it accepts connections.
    pub async fn restart(&mut self) {
        assert!(
            self.try_start().await,
            "redis-server on port {} exited or the port was taken by another process",
            self.port
        );
    }

    /// Starts the server on its port; false when it exits first or another process serves
    /// that port.
    async fn try_start(&mut self) -> bool {
        self.kill();
        let mut command = Command::new("redis-server");
        command
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", ""])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        match &self.dir {
            Some(dir) => {
                command.args(["--appendonly", "yes", "--appendfsync", "always", "--dir"]);
                command.arg(dir);
            }
            None => {
                command.args(["--appendonly", "no", "--dir"]);
                command.arg(self.scratch.path());
            }
        }
        if let Some(port) = self.replica_of {
            command.args(["--replicaof", "127.0.0.1", &port.to_string()]);
        }
        let child = self
            .child
            .insert(command.spawn().expect("start redis-server"));
        wait_serving(child, self.port).await
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits until `child` serves `port`: false when it exits first (another process held the
/// port, or the cluster bus port, when it bound) or another server answers there, so the caller
/// starts over on new ports instead of waiting out a server that is gone.
pub async fn wait_serving(child: &mut Child, port: u16) -> bool {
    // Poll the port: the client's own reconnects back off for longer.
    for _ in 0..400 {
        if let Some(serving) = serving_pid(port).await {
            return serving == child.id();
        }
        if child
            .try_wait()
            .expect("try_wait on redis-server")
            .is_some()
        {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("redis-server on port {port} did not accept connections within 10s");
}

/// The process id of the Redis server answering on `port` (`INFO server`), if one answers.
pub async fn serving_pid(port: u16) -> Option<u32> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n")
        .await
        .ok()?;
    let mut reply = Vec::new();
    let mut buffer = [0u8; 4096];
    while !String::from_utf8_lossy(&reply).contains("process_id:") || !reply.ends_with(b"\r\n") {
        let read = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buffer))
            .await
            .ok()?
            .ok()?;
        if read == 0 {
            return None;
        }
        reply.extend_from_slice(&buffer[..read]);
    }
    String::from_utf8_lossy(&reply)
        .lines()
        .find_map(|line| line.strip_prefix("process_id:"))
        .and_then(|pid| pid.trim().parse().ok())
}

fn installed() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("local addr").port()
}

/// The environment of a proxy whose store is the Redis at `url`.
pub fn store_env(url: &str) -> [(&'static str, &str); 2] {
    [
        ("ENGRAM_STORE__BACKEND", "redis"),
        ("ENGRAM_STORE__REDIS_URL", url),
    ]
}
