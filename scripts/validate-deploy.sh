#!/usr/bin/env bash
# Validates the deployment files offline: the Dockerfile, deploy/kubernetes/*.yaml, the Grafana
# dashboard and the Helm charts (helm lint and helm template for several value sets, every
# rendered object through kubernetes-validate --strict, every rendered config.yaml through
# `engram serve --check-config`). scripts/test.sh runs it; it also runs alone.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

ensure_venv
# The checks run the binary on the rendered configs (after `cargo test` this builds nothing).
cargo build --locked --quiet --bin engram
target_dir=$(cargo metadata --locked --format-version 1 --no-deps |
  "$VENV/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
exec "$VENV/bin/python" scripts/validate_deploy.py "$target_dir/debug/engram"
