//! Tenant isolation as a randomised property: random schedules of requests from identities that
//! share user ids across tenants, interleaved concurrently (streams and not, several sessions,
//! normal and read-only), while the worker applies memory behind them. No response may ever
//! carry another identity's secret, and each identity's memory holds only its own.
//!
//! The property holds with identities carried by headers (a sidecar's trust) and by client keys
//! (`identity.trust: client_keys`, a key per tenant, the user still from its header).
//!
//! The schedules come from fixed seeds (reproducible in CI); `ENGRAM_ISOLATION_SEEDS=1,2,3`
//! runs others.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail loudly"
)]

mod common;

use std::time::Duration;

use common::memory::{export, wait_drained};
use common::{Process, mock, post_json, proxy};
use serde_json::json;

/// The same user ids in several tenants: a key mix-up between tenants would show.
const IDENTITIES: [(&str, &str); 6] = [
    ("t1", "u1"),
    ("t1", "u2"),
    ("t2", "u1"),
    ("t2", "u2"),
    ("t3", "u1"),
    ("t3", "admin"),
];

fn secret(identity: usize) -> String {
    format!(
        "zq{identity}x{}x{}code",
        IDENTITIES[identity].0, IDENTITIES[identity].1
    )
}

/// xorshift64*: a tiny deterministic generator, enough to draw schedules from a seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, bound: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % bound
    }
}

#[derive(Debug, Clone)]
struct Step {
    identity: usize,
    session: usize,
    stream: bool,
    read_only: bool,
    /// Whether this request states the identity's secret (otherwise it asks about it).
    states: bool,
}

fn schedule(seed: u64, steps: usize) -> Vec<Step> {
    let mut rng = Rng(seed.max(1));
    (0..steps)
        .map(|_| Step {
            identity: rng.below(IDENTITIES.len()),
            session: rng.below(3),
            stream: rng.below(2) == 0,
            read_only: rng.below(5) == 0,
            states: rng.below(3) != 0,
        })
        .collect()
}

/// How a request says whose it is.
#[derive(Debug, Clone, Copy)]
enum Carrier {
    /// `x-engram-tenant` and `x-engram-user` (`identity.trust: headers`).
    Headers,
    /// The tenant's client key and `x-engram-user` (`identity.trust: client_keys`); every
    /// other request also repeats its tenant in `x-engram-tenant`, which is allowed.
    ClientKeys,
}

const TENANTS: [&str; 3] = ["t1", "t2", "t3"];

fn client_key(tenant: &str) -> String {
    format!("ck-{tenant}-4be1")
}

/// Sends one step; returns the response body as text (the echo mock puts the prompt it got
/// into the reply, so any injected memory is in there).
async fn send(chat_url: &str, step: &Step, carrier: Carrier) -> String {
    let (tenant, user) = IDENTITIES[step.identity];
    let text = if step.states {
        format!("Remember my code word, it is {}.", secret(step.identity))
    } else {
        "What is my code word?".to_owned()
    };
    let body = json!({
        "model": "gpt-test",
        "messages": [{"role": "user", "content": text}],
        "stream": step.stream,
    });
    let session = format!("s{}", step.session);
    let auth = format!("Bearer {}", client_key(tenant));
    let mut headers = vec![
        ("x-engram-user", user),
        ("x-engram-session", session.as_str()),
    ];
    match carrier {
        Carrier::Headers => headers.push(("x-engram-tenant", tenant)),
        Carrier::ClientKeys => {
            headers.push(("authorization", auth.as_str()));
            if step.session == 0 {
                headers.push(("x-engram-tenant", tenant));
            }
        }
    }
    if step.read_only {
        headers.push(("x-engram-mode", "read-only"));
    }
    let reply = post_json(chat_url, &body, &headers).await;
    assert_eq!(reply.status, 200);
    String::from_utf8_lossy(&reply.body).into_owned()
}

fn assert_only_own(seed: u64, step: &Step, text: &str) {
    for (other, identity) in IDENTITIES.iter().enumerate() {
        if other != step.identity {
            assert!(
                !text.contains(&secret(other)),
                "seed {seed}: {:?} saw the secret of {identity:?} in: {text}",
                IDENTITIES[step.identity],
            );
        }
    }
}

#[tokio::test]
async fn random_interleavings_never_show_one_identity_another_ones_memory() {
    let upstream = mock(&["--echo"]);
    let proxy = proxy(&upstream.address, &[]);
    never_shows_another_ones_memory(&proxy, Carrier::Headers).await;
}

#[tokio::test]
async fn with_client_keys_random_interleavings_never_show_another_ones_memory() {
    let upstream = mock(&["--echo"]);
    let keys = TENANTS
        .map(|tenant| format!("{tenant}={}", client_key(tenant)))
        .join(",");
    let proxy = proxy(
        &upstream.address,
        &[
            ("ENGRAM_IDENTITY__TRUST", "client_keys"),
            ("ENGRAM_CLIENT_KEYS", &keys),
            ("ENGRAM_UPSTREAM__API_KEY_ENV", "TEST_UPSTREAM_KEY"),
            ("TEST_UPSTREAM_KEY", "sk-engram-upstream"),
        ],
    );
    never_shows_another_ones_memory(&proxy, Carrier::ClientKeys).await;
}

async fn never_shows_another_ones_memory(proxy: &Process, carrier: Carrier) {
    let seeds: Vec<u64> = match std::env::var("ENGRAM_ISOLATION_SEEDS") {
        Ok(list) => list
            .split(',')
            .map(|seed| seed.trim().parse().unwrap())
            .collect(),
        Err(_) => vec![0x15_0A7E, 0xC0FFEE, 20_261_123],
    };
    let mut injected_own = 0;
    for seed in seeds {
        let steps = schedule(seed, 48);
        // Eight requests in flight at a time, in schedule order.
        for wave in steps.chunks(8) {
            let mut tasks = tokio::task::JoinSet::new();
            for step in wave.iter().cloned() {
                let chat_url = proxy.url("/v1/chat/completions");
                tasks.spawn(async move {
                    let text = send(&chat_url, &step, carrier).await;
                    (step, text)
                });
            }
            for (step, text) in tasks.join_all().await {
                assert_only_own(seed, &step, &text);
                if !step.states && text.contains(&secret(step.identity)) {
                    injected_own += 1;
                }
            }
        }
        wait_drained(proxy, Duration::from_secs(60)).await;
    }
    // The property is not vacuous: memory was injected, each identity got its own back.
    assert!(
        injected_own > 0,
        "no question was ever answered from memory"
    );
    for (identity, (tenant, user)) in IDENTITIES.iter().enumerate() {
        let memory = export(proxy, tenant, user).await.to_string();
        for (other, other_identity) in IDENTITIES.iter().enumerate() {
            if other != identity {
                assert!(
                    !memory.contains(&secret(other)),
                    "{tenant}/{user}'s memory holds {other_identity:?}'s secret"
                );
            }
        }
    }
}
