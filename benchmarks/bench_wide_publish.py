"""How long the longest Redis command of a wide job's publish holds Redis, drafted or inline.

A job of ``--ranks`` ranks (100,000: ``max_world_size``) on a private Redis; its first version
is published by ``advance_job`` twice, each on a fresh job: with the schedules passed to the
publish script as its arguments (every rank inline, as before drafts) and drafted (written 1,000
ranks a command, then renamed by the script, as ``WorkerStore.publish`` does above 1,000
ranks). Printed: the slow log's longest commands of each (Redis's own time: every other client
waits that long), and the wall time of ``advance_job``.

    python benchmarks/bench_wide_publish.py [--ranks 100000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.embedded import EmbeddedRedis  # noqa: E402
from coordinator.tasks import advance_job  # noqa: E402
from protocol import store_worker  # noqa: E402
from protocol.store import JobStore  # noqa: E402
from tests.helpers import wide_job  # noqa: E402

SCHEDULER = "tests.toy_schedulers:StepDown"


def publish_once(
    conn: redis.Redis, job_id: str, world: int
) -> tuple[float, list[tuple[float, str]]]:
    """Publish a fresh job's first version; its wall time and the slow log's top commands."""
    wide_job(JobStore(conn), job_id, world, SCHEDULER)
    conn.config_set("slowlog-log-slower-than", 0)  # from here: the registrations are not logged
    conn.slowlog_reset()
    start = time.perf_counter()
    assert advance_job(job_id, conn=conn) == [1]
    wall = time.perf_counter() - start
    conn.config_set("slowlog-log-slower-than", 10_000)
    log = conn.execute_command("SLOWLOG", "GET", 1_000_000, NEVER_DECODE=True)
    named = [(e[2] / 1000, b" ".join(e[3][:2]).decode(errors="replace")) for e in log]
    top = sorted(t for t in named if not t[1].upper().startswith("SLOWLOG"))[::-1][:3]
    return wall, top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=100_000)
    args = parser.parse_args()
    drafted_above = store_worker.INLINE_SCHEDULES
    with EmbeddedRedis() as server:
        conn = redis.Redis.from_url(server.url)
        conn.config_set("slowlog-max-len", 1_000_000)
        print(f"first version of a {args.ranks:,}-rank job (slow log: Redis's time per command)")
        for name, inline_upto in (("inline (one script call)", 10**9), ("drafted", drafted_above)):
            store_worker.INLINE_SCHEDULES = inline_upto
            wall, top = publish_once(conn, name.split()[0], args.ranks)
            longest = ", ".join(f"{ms:.1f} ms {command}" for ms, command in top)
            print(f"  {name:<26} advance_job {wall:5.2f} s; longest commands: {longest}")
        store_worker.INLINE_SCHEDULES = drafted_above


if __name__ == "__main__":
    main()
