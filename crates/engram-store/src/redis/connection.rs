//! One Redis server or a Redis Cluster behind one connection type, the hash slot of a key, and
//! `WAIT` sent to the node that holds a key.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

/// Slots of a Redis Cluster.
pub const SLOTS: u16 = 16384;

/// A multiplexed connection to one server (reconnecting on its own) or to a cluster (routing
/// each command to the master of its key's slot, following MOVED/ASK and refreshing the
/// topology when it changes).
#[derive(Clone)]
pub enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// Where and how to connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// One URL for a single server; for a cluster, one or more of its nodes (the rest are
    /// discovered).
    pub urls: Vec<String>,
    pub cluster: bool,
    pub connect_timeout: Duration,
    pub response_timeout: Duration,
}

impl Connection {
    pub async fn open(target: &Target) -> RedisResult<Connection> {
        if target.cluster {
            let client = ClusterClientBuilder::new(target.urls.clone())
                .connection_timeout(target.connect_timeout)
                .response_timeout(target.response_timeout)
                // Retries (a node restarting, a slot moving) back off from 10 ms to 500 ms;
                // the response timeout bounds a command with all its retries.
                .retries(6)
                .min_retry_wait(10)
                .max_retry_wait(500)
                .build()?;
            return Ok(Connection::Cluster(client.get_async_connection().await?));
        }
        let url = target.urls.first().map(String::as_str).unwrap_or_default();
        let client = redis::Client::open(url)?;
        // Reconnects back off from 10 ms up to 1 s, so a restarted server is found quickly.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(target.connect_timeout)
            .set_response_timeout(target.response_timeout)
            .set_exponent_base(2)
            .set_factor(10)
            .set_max_delay(1000)
            .set_number_of_retries(6);
        Ok(Connection::Single(
            ConnectionManager::new_with_config(client, config).await?,
        ))
    }

    /// `WAIT replicas timeout` on the node that holds `key`, over the connection that wrote it,
    /// so it waits for that write (and any later one on the connection). Returns how many
    /// replicas acknowledged.
    pub async fn wait_for_replicas(
        &mut self,
        key: &str,
        replicas: u32,
        timeout: Duration,
    ) -> RedisResult<u32> {
        let mut wait = redis::cmd("WAIT");
        wait.arg(replicas)
            .arg(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
        match self {
            Connection::Single(connection) => wait.query_async(connection).await,
            Connection::Cluster(connection) => {
                let route = Route::new(slot(key.as_bytes()), SlotAddr::Master);
                let reply = connection
                    .route_command(
                        &wait,
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
                    )
                    .await?;
                redis::from_redis_value(&reply)
            }
        }
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(connection) => connection.req_packed_command(cmd),
            Connection::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
            Connection::Cluster(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(connection) => connection.get_db(),
            Connection::Cluster(connection) => connection.get_db(),
        }
    }
}

/// The cluster slot of a key: CRC16 (XMODEM) of its hash tag (the part between the first `{`
/// and the next `}`, when not empty) or of the whole key, modulo 16384.
pub fn slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&byte| byte == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&byte| byte == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16_xmodem(tagged) % SLOTS
}

fn crc16_xmodem(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The hash tag of queue shard `shard` of `shards`: `queue-<shard>-<n>` with the smallest `n`
/// whose slot falls in the shard's even share of the slot range. A cluster created with
/// `redis-cli --cluster create` gives each master one contiguous range, so the shards spread
/// over the masters like the users do.
pub fn queue_tag(shard: u32, shards: u32) -> String {
    let shards = u64::from(shards.max(1));
    let shard = u64::from(shard) % shards;
    let start = shard * u64::from(SLOTS) / shards;
    let end = (shard + 1) * u64::from(SLOTS) / shards;
    // Each try lands in the range with probability 1/shards: ~shards tries. The bound only
    // guards against a range that cannot be hit (more shards than slots).
    for n in 0..(shards * 64).max(1024) {
        let tag = format!("queue-{shard}-{n}");
        let slot = u64::from(slot(tag.as_bytes()));
        if (start..end).contains(&slot) {
            return tag;
        }
    }
    format!("queue-{shard}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_the_cluster_specification() {
        // Examples from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16_xmodem(b"123456789"), 0x31c3);
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"{user1000}.following"), slot(b"{user1000}.followers"));
        assert_eq!(slot(b"{user1000}.following"), slot(b"user1000"));
        // An empty tag does not count: the whole key is hashed.
        assert_eq!(slot(b"foo{}{bar}"), crc16_xmodem(b"foo{}{bar}") % SLOTS);
        assert_eq!(slot(b"foo{{bar}}zap"), slot(b"{bar"));
    }

    #[test]
    fn queue_tags_spread_over_the_slot_range() {
        let shards = 8u32;
        for shard in 0..shards {
            let tag = queue_tag(shard, shards);
            let slot = u32::from(slot(tag.as_bytes()));
            let share = u32::from(SLOTS) / shards;
            assert_eq!(slot / share, shard, "{tag} → {slot}");
        }
        assert_eq!(queue_tag(0, 1), "queue-0-0");
        assert_eq!(queue_tag(3, 4), queue_tag(3, 4));
    }
}
