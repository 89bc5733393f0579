#!/usr/bin/env bash
# The scale-out benchmark: three engram replicas on a local Redis Cluster (3 masters + 3
# replicas, started by the benchmark) at stepped rates; added latency, job lag, Redis commands
# and CPU, bytes per user and turn (docs/scaling.md).
# Usage: ./benches/cluster.sh [--duration-secs N] [--cluster-rates 100,200,400] [--users N]
#   [--replicas 3]
# Installs redis-server/redis-cli and taskset when missing (as root).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ]; then
  if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    apt-get update -qq && apt-get install -y -qq redis-server redis-tools >/dev/null
  fi
  if ! command -v taskset >/dev/null; then
    apt-get update -qq && apt-get install -y -qq util-linux >/dev/null
  fi
fi
exec cargo bench --bench cluster -- "$@"
