#!/usr/bin/env bash
# Runs engram's whole test suite. Installs what the tests need when it is missing:
# a Python venv (.venv) with the official `openai` SDK for the end-to-end SDK test, schemathesis
# for fuzzing the management API from its OpenAPI document, and the
# deployment checks' helm-python-sdk and kubernetes-validate (scripts/common.sh), and
# redis-server and redis-cli for the Redis tests (they start their own servers and clusters; none
# is started here).
set -euo pipefail  # pipefail: a failing cargo test fails the script through tee
cd "$(dirname "$0")/.."
source scripts/common.sh

# tests/faults.rs holds 1,000 streams open at once (client, proxy and mock sockets): raise the
# soft descriptor limit as far as the hard one allows.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# The suite builds each crate once, so incremental caches buy nothing and would double the target
# directory (2.6 of 5.5 GB on a clean clone); a CI run has failed for want of disk with them.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
log "free disk where the build goes"
df -h . || true

ensure_venv
export ENGRAM_TEST_PYTHON="$PWD/$VENV/bin/python"

# redis-server for tests/store_redis.rs and tests/memory_redis.rs, and redis-cli (same package)
# for tests/redis_cluster.rs, which joins six servers into a cluster; requiring them makes a
# missing one fail, not skip.
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  apt_install redis-server
fi
export ENGRAM_REQUIRE_REDIS=1

log "cargo fmt --check"
cargo fmt --all -- --check

log "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

log "cargo doc (broken intra-doc links fail)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet

log "cargo test"
# Every crate of the workspace: the engine, the sidecar, the mock and the evaluation
# (tests/layers.rs checks their order and dependency trees). Doc tests are left out (the crates
# have none); the totals line below sums every test binary and the deployment checks.
results=$(mktemp)
trap 'rm -f "$results"' EXIT
cargo test --workspace --locked --no-fail-fast --lib --bins --tests 2>&1 | tee "$results"

log "deployment files (helm lint, helm template, kubernetes-validate --strict)"
# Prints a cargo-style `test result:` line, so its checks count in the totals below.
./scripts/validate-deploy.sh 2>&1 | tee -a "$results"
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) s += $i } }
     END { printf "\n%d passed, %d failed, %d skipped\n", p, f, s }' "$results"
