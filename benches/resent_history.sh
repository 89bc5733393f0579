#!/usr/bin/env bash
# Peak RSS and lost recordings when one user resends a long history faster than engram's core
# records it: engram (release build, embedded store in a temporary directory, one tokio thread)
# alone on core 1 and the mock upstream and oha on core 0, both cores also running a busy loop
# at normal priority, as on a node whose other pods keep every core busy. oha sends one user
# (`solo`) RATE req/s for SECS s, open loop, 64 connections; every request carries about 60 KB
# of earlier conversation before its new message. Prints engram's peak RSS (VmRSS sampled every
# 0.2 s), oha's throughput, and the recorder's counters at the end of the load and once the
# queue drained (at most 120 s later). No paired baseline: at this body size the history
# benchmark's second oha and the mock saturate core 0 before engram is pushed.
#
# Usage: ./benches/resent_history.sh [SECS] [RATE] [ENGRAM_BINARY]   (defaults 30, 1000, the
#        release build, built when missing). Needs oha, taskset, curl and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-30}
rate=${2:-1000}
engram=${3:-target/release/engram}
[ -x "$engram" ] || cargo build --release --locked -p engram
[ -x target/release/engram-mock ] || cargo build --release --locked -p engram-mock
for tool in oha taskset curl python3; do
  command -v "$tool" >/dev/null || { echo "$tool is needed" >&2; exit 1; }
done
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

dir=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
python3 - > "$dir/body.json" <<'PY'
import json
messages = [{"role": "system", "content": "You are a helpful assistant."}]
for i in range(60):
    role = "user" if i % 2 == 0 else "assistant"
    text = "we talked about the garden, the trip to Lisbon and the sourdough starter. "
    messages.append({"role": role, "content": f"turn {i}: " + text * 13})
messages.append({"role": "user", "content": "What should I plant next to the tomatoes?"})
print(json.dumps({"model": "gpt-4o-mini", "messages": messages}))
PY
mock_port=$(free_port)
port=$(free_port)
taskset -c 0 target/release/engram-mock --listen "127.0.0.1:$mock_port" > "$dir/mock.log" 2>&1 &
pids+=($!)
ENGRAM_SERVER__WORKER_THREADS=1 ENGRAM_STORE__DATA_DIR="$dir/data" taskset -c 1 "$engram" serve \
  --listen "127.0.0.1:$port" --upstream "http://127.0.0.1:$mock_port/v1" > "$dir/engram.log" 2>&1 &
engram_pid=$!
pids+=("$engram_pid")
url="http://127.0.0.1:$port"
for _ in $(seq 1 100); do curl -sf "$url/healthz" >/dev/null 2>&1 && break; sleep 0.1; done
for _ in $(seq 1 20); do
  curl -s -o /dev/null -H 'content-type: application/json' -H 'x-engram-user: warm' \
    -d @"$dir/body.json" "$url/v1/chat/completions"
done
taskset -c 0 sh -c 'while :; do :; done' &
busy0=$!
taskset -c 1 sh -c 'while :; do :; done' &
busy1=$!
pids+=("$busy0" "$busy1")
(
  peak=0
  while kill -0 "$engram_pid" 2>/dev/null; do
    rss=$(awk '/VmRSS/ {print $2}' "/proc/$engram_pid/status" 2>/dev/null || true)
    if [ -n "$rss" ] && [ "$rss" -gt "$peak" ]; then peak=$rss; echo "$peak" > "$dir/peak"; fi
    sleep 0.2
  done
) &
pids+=($!)
taskset -c 0 oha -z "${secs}s" -q "$rate" -c 64 --latency-correction --no-tui -m POST \
  -H 'content-type: application/json' -H 'x-engram-user: solo' -D "$dir/body.json" \
  "$url/v1/chat/completions" > "$dir/oha.txt" 2>&1
curl -s "$url/metrics" > "$dir/metrics.load"
kill "$busy0" "$busy1"
for _ in $(seq 1 120); do
  depth=$(curl -s "$url/metrics" | awk '/^engram_queue_depth / {print $2}')
  [ "$depth" = "0" ] && break
  sleep 1
done
curl -s "$url/metrics" > "$dir/metrics.end"
series='^engram_outbox_jobs_total|^engram_memory_fail_open_total|^engram_recordings_in_flight'
echo "$("$engram" --version 2>/dev/null || echo "$engram"), $rate req/s for $secs s"
echo "peak RSS: $(( $(cat "$dir/peak") / 1024 )) MiB"
grep -E 'Success rate|Requests/sec' "$dir/oha.txt" | tr -s ' \t' ' '
echo "at the end of the load:"
grep -E "$series" "$dir/metrics.load" | sed 's/^/  /'
echo "once drained (queue depth $depth):"
grep -E '^engram_outbox_jobs_total' "$dir/metrics.end" | sed 's/^/  /'
