#!/usr/bin/env bash
# The proxy's added latency, side by side with direct-to-mock, per percentile.
# Usage: ./benches/overhead.sh [--duration-secs N] [--rates 500,1000,2000] [--stream-rate N]
#   [--memory embedded,redis,redis-cluster] [--memory-rate N] [--users N]
#   [--cluster-rates 100,200,400] [--replicas 3]
# Installs its load generator (oha, from crates.io) and taskset when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v oha >/dev/null && [ ! -x "$HOME/.cargo/bin/oha" ]; then
  echo "installing oha (load generator) with cargo install"
  cargo install --locked oha
fi
if ! command -v taskset >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && apt-get install -y -qq util-linux >/dev/null
fi
exec cargo bench --bench overhead -- "$@"
