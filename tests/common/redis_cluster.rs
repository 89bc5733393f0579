//! A real Redis Cluster for tests and benchmarks: `redis-server --cluster-enabled yes` on free
//! loopback ports (3 masters + 3 replicas by default), joined with `redis-cli --cluster create
//! … --cluster-replicas 1 --cluster-yes`, killed on drop. Nodes time out after 1 s, so a
//! killed master fails over within a few seconds. Without `redis-server` or `redis-cli` on
//! PATH, `start` says so and returns `None`, unless `ENGRAM_REQUIRE_REDIS=1` (then it panics,
//! so CI never skips silently).

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the harness"
)]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    reason = "test harness: a failure should fail the test loudly; skips are printed"
)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Milliseconds before a silent node counts as failed (and its replica takes over).
pub const NODE_TIMEOUT_MS: u64 = 1000;

pub struct RedisCluster {
    pub nodes: Vec<Node>,
    dir: tempfile::TempDir,
}

pub struct Node {
    pub port: u16,
    bus_port: u16,
    child: Option<Child>,
}

impl RedisCluster {
    /// Three masters, each with one replica.
    pub async fn start() -> Option<RedisCluster> {
        RedisCluster::start_with(3, 1, &[]).await
    }

    /// `masters` masters with `replicas` replicas each; `launcher` prefixes each
    /// `redis-server` command (e.g. `taskset -c 0` in benchmarks).
    pub async fn start_with(
        masters: usize,
        replicas: usize,
        launcher: &[&str],
    ) -> Option<RedisCluster> {
        if !installed("redis-server") || !installed("redis-cli") {
            if std::env::var("ENGRAM_REQUIRE_REDIS").is_ok_and(|value| value == "1") {
                panic!(
                    "ENGRAM_REQUIRE_REDIS=1 but redis-server or redis-cli is not on PATH; install redis-server (it has both)"
                );
            }
            println!("SKIPPED: redis-server or redis-cli not installed (Redis Cluster tests)");
            return None;
        }
        let mut cluster = RedisCluster {
            nodes: Vec::new(),
            dir: tempfile::tempdir().unwrap(),
        };
        let count = masters * (1 + replicas);
        // Many test processes pick free ports at once: if another took one of ours, start
        // over on new ones rather than join someone else's server.
        for attempt in 0.. {
            for node in &mut cluster.nodes {
                node.kill();
            }
            cluster.nodes.clear();
            let mut ports = free_ports(count * 2).into_iter();
            for _ in 0..count {
                let mut node = Node {
                    port: ports.next().unwrap(),
                    bus_port: ports.next().unwrap(),
                    child: None,
                };
                node.spawn(cluster.dir.path(), launcher);
                cluster.nodes.push(node);
            }
            let mut ours = true;
            for node in &mut cluster.nodes {
                ours &= node.wait_accepting().await;
            }
            if ours {
                break;
            }
            assert!(attempt < 4, "no free ports for the cluster in five tries");
        }
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &cluster.nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        let output = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        cluster.wait_healthy(Duration::from_secs(30)).await;
        if replicas > 0 {
            cluster.wait_replicated(Duration::from_secs(30)).await;
        }
        Some(cluster)
    }

    /// The seed list engram takes (`store.redis_url` with `store.redis_cluster: true`).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(|node| format!("redis://127.0.0.1:{}", node.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Waits until every running node says `cluster_state:ok` and every slot has a master that
    /// runs.
    pub async fn wait_healthy(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if self.healthy() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not become healthy within {within:?}:\n{}",
                self.running()
                    .next()
                    .map(|node| cli(node.port, &["cluster", "nodes"]))
                    .unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until every running master has a replica in sync (so `WAIT 1` can succeed).
    pub async fn wait_replicated(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let port = self.running().next().expect("no node runs").port;
            let masters = masters(&cli(port, &["cluster", "nodes"]));
            let synced = masters
                .iter()
                .filter(|master| self.running().any(|node| node.port == master.port))
                .all(|master| {
                    cli(master.port, &["info", "replication"])
                        .lines()
                        .any(|line| line.starts_with("slave") && line.contains("state=online"))
                });
            if synced {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the masters' replicas did not come in sync within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn healthy(&self) -> bool {
        let running: Vec<u16> = self.running().map(|node| node.port).collect();
        running
            .iter()
            .all(|&port| cli(port, &["cluster", "info"]).contains("cluster_state:ok"))
            && running.first().is_some_and(|&port| {
                let masters = masters(&cli(port, &["cluster", "nodes"]));
                let covered: usize = masters
                    .iter()
                    .filter(|master| running.contains(&master.port))
                    .map(|master| master.slots.iter().map(|(a, b)| b - a + 1).sum::<usize>())
                    .sum();
                covered == 16384
            })
    }

    fn running(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().filter(|node| node.child.is_some())
    }

    /// The index (in `nodes`) of the master serving `slot` now.
    pub fn master_of_slot(&self, slot: u16) -> usize {
        let port = self.running().next().expect("no node runs").port;
        let masters = masters(&cli(port, &["cluster", "nodes"]));
        let master = masters
            .iter()
            .find(|master| {
                master
                    .slots
                    .iter()
                    .any(|&(a, b)| (a..=b).contains(&usize::from(slot)))
            })
            .expect("no master serves the slot");
        self.nodes
            .iter()
            .position(|node| node.port == master.port)
            .expect("the master is one of ours")
    }

    /// A command through `redis-cli -c` (following redirects to the key's master); its
    /// output.
    pub fn command(&self, args: &[&str]) -> String {
        let port = self.running().next().expect("no node runs").port;
        let mut all = vec!["-c"];
        all.extend_from_slice(args);
        cli(port, &all)
    }

    /// Kills a node at once (SIGKILL): what it had not replicated is gone.
    pub fn kill(&mut self, node: usize) {
        self.nodes[node].kill();
    }

    /// Starts a killed node again on its port; it rejoins the cluster (as a replica if it was
    /// failed over) with no data of its own.
    pub async fn restart(&mut self, node: usize) {
        let dir = self.dir.path().to_owned();
        self.nodes[node].spawn(&dir, &[]);
        assert!(
            self.nodes[node].wait_accepting().await,
            "a restarted node exited or another process took its port"
        );
    }

    /// `INFO commandstats` summed over the running masters: (command, calls). Commands a script
    /// runs count too, under their own names.
    pub fn command_calls(&self) -> Vec<(String, u64)> {
        let mut totals: std::collections::BTreeMap<String, u64> = Default::default();
        for port in self.master_ports() {
            for line in cli(port, &["info", "commandstats"]).lines() {
                // cmdstat_get:calls=12,usec=…
                let Some((name, rest)) = line
                    .strip_prefix("cmdstat_")
                    .and_then(|line| line.split_once(':'))
                else {
                    continue;
                };
                let calls = rest
                    .split(',')
                    .find_map(|field| field.strip_prefix("calls="))
                    .and_then(|calls| calls.parse::<u64>().ok())
                    .unwrap_or(0);
                *totals.entry(name.to_owned()).or_default() += calls;
            }
        }
        totals.into_iter().collect()
    }

    /// CPU seconds (user + system) the running masters have used.
    pub fn cpu_seconds_of_masters(&self) -> f64 {
        self.master_ports()
            .into_iter()
            .map(|port| {
                cli(port, &["info", "cpu"])
                    .lines()
                    .filter_map(|line| {
                        line.strip_prefix("used_cpu_sys:")
                            .or_else(|| line.strip_prefix("used_cpu_user:"))
                    })
                    .filter_map(|value| value.trim().parse::<f64>().ok())
                    .sum::<f64>()
            })
            .sum()
    }

    /// Ports of the running masters.
    fn master_ports(&self) -> Vec<u16> {
        let port = self.running().next().expect("no node runs").port;
        masters(&cli(port, &["cluster", "nodes"]))
            .iter()
            .filter(|master| self.running().any(|node| node.port == master.port))
            .map(|master| master.port)
            .collect()
    }

    /// Used memory (bytes) summed over the running masters.
    pub fn used_memory_of_masters(&self) -> u64 {
        self.master_ports()
            .into_iter()
            .map(|port| {
                cli(port, &["info", "memory"])
                    .lines()
                    .find_map(|line| line.strip_prefix("used_memory:"))
                    .and_then(|value| value.trim().parse::<u64>().ok())
                    .unwrap_or(0)
            })
            .sum()
    }

    /// Process ids of the running nodes (for CPU accounting).
    pub fn pids(&self) -> Vec<u32> {
        self.running()
            .filter_map(|node| node.child.as_ref().map(Child::id))
            .collect()
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
    }
}

impl Node {
    fn spawn(&mut self, dir: &Path, launcher: &[&str]) {
        let mut command = match launcher.split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg("redis-server");
                command
            }
            None => Command::new("redis-server"),
        };
        let config: PathBuf = dir.join(format!("nodes-{}.conf", self.port));
        command
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--cluster-enabled", "yes"])
            .args(["--cluster-port", &self.bus_port.to_string()])
            .arg("--cluster-config-file")
            .arg(&config)
            .args(["--cluster-node-timeout", &NODE_TIMEOUT_MS.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            // A new replica syncs at once (the default waits 5 s for more replicas).
            .args(["--repl-diskless-sync-delay", "0"])
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(command.spawn().expect("start redis-server"));
    }

    /// Waits until the node answers; false when it exited or another process answers on its
    /// port.
    async fn wait_accepting(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => super::redis::wait_serving(child, self.port).await,
            None => false,
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A master line of `CLUSTER NODES`: its port and slot ranges.
struct Master {
    port: u16,
    slots: Vec<(usize, usize)>,
}

/// Masters that are not marked failed, from `CLUSTER NODES` output.
fn masters(nodes: &str) -> Vec<Master> {
    nodes
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags = fields.get(2)?;
            if !flags.contains("master") || flags.contains("fail") {
                return None;
            }
            // 127.0.0.1:7000@17000
            let port = fields
                .get(1)?
                .split('@')
                .next()?
                .rsplit(':')
                .next()?
                .parse()
                .ok()?;
            let slots = fields
                .iter()
                .skip(8)
                .filter(|range| !range.starts_with('['))
                .filter_map(|range| match range.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => range.parse().ok().map(|slot| (slot, slot)),
                })
                .collect();
            Some(Master { port, slots })
        })
        .collect()
}

/// `redis-cli -p <port> <args…>`'s output ("" when the node does not answer).
fn cli(port: u16, args: &[&str]) -> String {
    Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).into_owned())
        .unwrap_or_default()
}

fn installed(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// `count` distinct free ports (all held open until every one is chosen).
fn free_ports(count: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    listeners
        .iter()
        .map(|listener| listener.local_addr().expect("local addr").port())
        .collect()
}
