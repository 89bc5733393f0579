#!/usr/bin/env python3
"""The disk's floor under a durable receipt: appends of a small record, each followed by
fdatasync, at about 200 a second, as an append-only intake log would make them. Prints
p50/p90/p99/p99.9/max in milliseconds. Not a test.

Usage: python3 benches/fsync_tail.py [FILE] (default target/fsync-tail.log, removed after)
"""
import os
import sys
import time

path = sys.argv[1] if len(sys.argv) > 1 else "target/fsync-tail.log"
record = b"x" * 400
count = 4000
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
latencies = []
try:
    for _ in range(count):
        started = time.perf_counter()
        os.write(fd, record)
        os.fdatasync(fd)
        latencies.append(time.perf_counter() - started)
        time.sleep(0.004)
finally:
    os.close(fd)
    os.unlink(path)
latencies.sort()


def at(q):
    return latencies[int((len(latencies) - 1) * q)] * 1e3


print(
    f"append {len(record)} B + fdatasync, {count} at ~200/s: p50 {at(.5):.3f} p90 {at(.9):.3f} "
    f"p99 {at(.99):.3f} p99.9 {at(.999):.3f} max {latencies[-1] * 1e3:.3f} ms"
)
