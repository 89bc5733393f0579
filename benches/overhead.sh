#!/usr/bin/env bash
# engram's added latency over direct-to-mock, side by side with LiteLLM's proxy, in one run:
# direct, engram memory off, memory on (embedded), memory on (Redis), LiteLLM; stepped rates,
# saturation, streaming time to first chunk, large bodies, many streams in flight.
# Writes overhead.md, overhead.svg and overhead.json to docs/benchmarks/ (or --out DIR; a run of
# some systems or scenarios only goes to target/bench-partial/).
#
# Usage: ./benches/overhead.sh [--quick] [--duration-secs N] [--systems LIST] [--scenarios LIST]
#        ./benches/overhead.sh --help     (every option)
# The Redis Cluster scale-out benchmark is its own: ./benches/cluster.sh (docs/scaling.md).
# Installs what it needs when missing: oha (cargo install), taskset (apt, as root), and, when
# LiteLLM is measured, litellm[proxy] from PyPI into .venv-bench (done by the benchmark itself).
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
# 1,000 streams in flight hold ~2,000 sockets in the proxy: raise the descriptor limit.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || ulimit -n 65536 2>/dev/null || true
exec cargo bench --bench overhead -- "$@"
