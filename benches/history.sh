#!/usr/bin/env bash
# Memory that stays fast as it grows (issue 26): for each history size (default 100, 1,000,
# 10,000 and 50,000 turns of one user, preloaded through the worker), engram's added latency
# over a paired direct baseline at 200 req/s, worker apply time, store bytes, job lag, fail-opens
# and peak RSS; and one user at 1,000 req/s from an empty store (embedded and Redis).
# Writes history.md, history.svg and history.json to docs/benchmarks/ (or --out DIR; --quick
# goes to target/bench-quick/, a run of some sizes, scenarios or systems to
# target/bench-partial/).
#
# Usage: ./benches/history.sh [--quick] [--sizes LIST] [--scenarios sizes,adversarial] ...
#        ./benches/history.sh --help     (every option)
# Installs what it needs when missing: oha (cargo install), and as root taskset and
# redis-server (apt).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v oha >/dev/null && [ ! -x "$HOME/.cargo/bin/oha" ]; then
  echo "installing oha (load generator) with cargo install"
  cargo install --locked oha
fi
if ! command -v taskset >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && apt-get install -y -qq util-linux >/dev/null
fi
if ! command -v redis-server >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && apt-get install -y -qq redis-server >/dev/null || true
fi
# oha's connections and the paired baseline's, at 1,000 req/s: raise the descriptor limit.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || ulimit -n 65536 2>/dev/null || true
exec cargo bench --bench history -- "$@"
