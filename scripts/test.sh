#!/usr/bin/env bash
# Runs engram's whole test suite. Installs what the tests need when it is missing:
# a Python venv (.venv) with the official `openai` SDK for the end-to-end SDK test, and
# redis-server for the Redis store tests (they start their own servers; none is started here).
set -euo pipefail  # pipefail: a failing cargo test fails the script through tee
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*"; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
  log "installing $* with apt-get"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

# Python venv with the openai SDK.
VENV=.venv
if ! "$VENV/bin/python" -c "import openai" 2>/dev/null; then
  log "creating $VENV with the openai package"
  python3 -m venv "$VENV" 2>/dev/null || { apt_install python3-venv; rm -rf "$VENV"; python3 -m venv "$VENV"; }
  "$VENV/bin/pip" install --quiet --disable-pip-version-check openai
fi
export ENGRAM_TEST_PYTHON="$PWD/$VENV/bin/python"

# redis-server for tests/store_redis.rs; requiring it makes a missing server fail, not skip.
if ! command -v redis-server >/dev/null; then
  apt_install redis-server
fi
export ENGRAM_REQUIRE_REDIS=1

log "cargo fmt --check"
cargo fmt --all -- --check

log "cargo clippy"
cargo clippy --all-targets --locked -- -D warnings

log "cargo test"
# Doc tests are left out (the crate has none); the totals line below sums every test binary.
results=$(mktemp)
trap 'rm -f "$results"' EXIT
cargo test --locked --lib --bins --tests 2>&1 | tee "$results"
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) s += $i } }
     END { printf "\n%d passed, %d failed, %d skipped\n", p, f, s }' "$results"
