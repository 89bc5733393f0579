//! Command-line arguments only; `main.rs` runs them.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "engram",
    version,
    about = "An OpenAI-compatible proxy that gives LLM apps long-term memory"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy.
    Serve(ServeArgs),
    /// Call a running proxy's management API (token from ENGRAM_ADMIN_TOKEN); prints the JSON
    /// answer.
    Admin(AdminArgs),
    /// Moved to the `engram-eval` binary; says so instead of clap's unknown-command error.
    #[command(hide = true, disable_help_flag = true)]
    Eval(MovedArgs),
    /// Moved to the `engram-mock` binary; says so.
    #[command(name = "mock-upstream", hide = true, disable_help_flag = true)]
    MockUpstream(MovedArgs),
}

/// Whatever followed a command that moved to another binary.
#[derive(Debug, Args)]
pub struct MovedArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// YAML config file; without one the built-in defaults apply (see config.yaml).
    #[arg(long, env = "ENGRAM_CONFIG")]
    pub config: Option<PathBuf>,
    /// Overrides server.listen (port 0 picks a free port).
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Overrides upstream.base_url.
    #[arg(long)]
    pub upstream: Option<String>,
    /// Overrides store.backend and its location: `embedded:DIR` (store.data_dir) or
    /// `redis://HOST:PORT` (store.redis_url; `rediss://` for TLS).
    #[arg(long, value_name = "embedded:DIR|redis://HOST:PORT", value_parser = parse_store)]
    pub store: Option<StoreFlag>,
    /// Validate the configuration, print it, and exit.
    #[arg(long)]
    pub check_config: bool,
}

/// The `--store` flag: which backend, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreFlag {
    Embedded(PathBuf),
    Redis(String),
}

fn parse_store(value: &str) -> Result<StoreFlag, String> {
    const EXPECTED: &str = "expected embedded:DIR or redis://HOST:PORT";
    if let Some(dir) = value.strip_prefix("embedded:") {
        if dir.is_empty() {
            return Err(format!("the embedded store needs a directory ({EXPECTED})"));
        }
        return Ok(StoreFlag::Embedded(PathBuf::from(dir)));
    }
    let host = value
        .strip_prefix("redis://")
        .or_else(|| value.strip_prefix("rediss://"));
    match host {
        Some(rest) if !rest.is_empty() && !rest.starts_with(['/', ':']) => {
            Ok(StoreFlag::Redis(value.to_owned()))
        }
        Some(_) => Err(format!("the Redis URL names no host ({EXPECTED})")),
        None => Err(EXPECTED.to_owned()),
    }
}

#[derive(Debug, Args)]
pub struct AdminArgs {
    /// The proxy's base URL. Default: its server.listen address from the config (file and
    /// ENGRAM_* overrides), http://127.0.0.1:8080 without one.
    #[arg(long, env = "ENGRAM_URL")]
    pub url: Option<String>,
    /// Config file used to find the proxy's address when --url is not given.
    #[arg(long, env = "ENGRAM_CONFIG")]
    pub config: Option<PathBuf>,
    /// The tenant (x-engram-tenant). Default: a tenant token's own tenant, or the proxy's
    /// default tenant for the global token.
    #[arg(long, env = "ENGRAM_TENANT")]
    pub tenant: Option<String>,
    #[command(subcommand)]
    pub command: AdminCommand,
}

#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// Queue depth, local spool and worker counters (global token).
    Queue,
    /// A recorded exchange's job state.
    Job { user: String, job: String },
    /// The user's whole memory: every tier, manifests, provenance, raw log.
    Export { user: String },
    /// List the user's items.
    Items {
        user: String,
        #[command(flatten)]
        filter: ItemFilterArgs,
    },
    /// Search the user's items (ranked by relevance).
    Search {
        user: String,
        query: String,
        #[command(flatten)]
        filter: ItemFilterArgs,
    },
    /// Read, edit or delete one item (`fact:3`, `pinned:0`, `identity`, …).
    Item {
        #[command(subcommand)]
        action: ItemAction,
    },
    /// Pin a text, or with --item a fact (always injected).
    Pin {
        user: String,
        #[arg(required_unless_present = "item", conflicts_with = "item")]
        text: Option<String>,
        /// The fact to pin (`fact:3`) instead of a text.
        #[arg(long)]
        item: Option<String>,
    },
    /// Unpin a pin by its number.
    Unpin { user: String, pin: u32 },
    /// Set the identity block (an empty text clears it).
    Identity { user: String, text: String },
    /// Forget the user: every record in the store, the spool, the cache.
    Forget {
        user: String,
        /// Confirms the deletion.
        #[arg(long)]
        yes: bool,
    },
    /// What a turn's prompt was given, and why.
    Explain { user: String, turn: String },
    /// The management API's OpenAPI document.
    Openapi,
}

#[derive(Debug, Subcommand)]
pub enum ItemAction {
    Get {
        user: String,
        item: String,
    },
    /// Replace the item's text (identity, pinned, fact).
    Edit {
        user: String,
        item: String,
        text: String,
    },
    /// Delete the item and what was derived only from it.
    Delete {
        user: String,
        item: String,
    },
}

#[derive(Debug, Args)]
pub struct ItemFilterArgs {
    /// Only items of this kind (identity, pinned, fact, summary, episode, artifact, raw_turn).
    #[arg(long)]
    pub kind: Option<String>,
    /// Only items in this tier (new, current, old).
    #[arg(long)]
    pub tier: Option<String>,
    /// At most this many items (1-1000; the API's default is 100).
    #[arg(long)]
    pub limit: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_flags_name_a_backend_and_a_place() {
        assert_eq!(
            parse_store("embedded:/var/lib/engram"),
            Ok(StoreFlag::Embedded("/var/lib/engram".into()))
        );
        assert_eq!(
            parse_store("redis://redis:6379"),
            Ok(StoreFlag::Redis("redis://redis:6379".into()))
        );
        assert!(parse_store("rediss://cache.example:6380").is_ok());
        for bad in [
            "embedded:",
            "redis://",
            "redis://:6379",
            "postgres://db",
            "/data",
            "",
        ] {
            let error = parse_store(bad).unwrap_err();
            assert!(
                error.contains("embedded:DIR or redis://HOST:PORT"),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
