"""Scaled out: several coordinators in one consumer group and several rq workers, many jobs.

Entries of one job land on different coordinators and its versions on different workers; the
Lua-atomic store and the per-job lease must still give every job each version exactly once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import redis
from rq import Worker

from coordinator.service import Coordinator
from protocol import keys
from protocol.store import JobStore
from tests.helpers import (
    FAST_RECOVERY,
    make_settings,
    register,
    result,
    running,
    start_perseus,
    stop,
    wait_for,
)
from worker_client.hook.session import CoordinatorClient

JOBS, RANKS, ROUNDS = 6, 4, 3


def test_two_coordinators_and_two_workers_serve_many_jobs(r, redis_url, tmp_path):
    coordinators = [
        Coordinator(redis.Redis.from_url(redis_url), make_settings(redis_url), consumer=name)
        for name in ("coord-a", "coord-b")
    ]
    with ExitStack() as stack:
        for c in coordinators:
            stack.enter_context(running(c, block_ms=20))
        workers = [
            start_perseus(
                ["worker", "--simple", "--redis-url", redis_url],
                tmp_path,
                f"worker{i}.log",
                FAST_RECOVERY,
            )
            for i in range(2)
        ]
        store = JobStore(r)
        try:
            with ThreadPoolExecutor(JOBS) as pool:
                clients = [CoordinatorClient(redis_url, reply_timeout=20) for _ in range(JOBS)]
                job_ids = list(pool.map(lambda c: register(c, pp=RANKS), clients))
                assert len(set(job_ids)) == JOBS

                for version in range(1, ROUNDS + 1):
                    wait_for(lambda v=version: all(store.version(j) == v for j in job_ids), 30)

                    def report_all(i: int, v: int = version) -> None:
                        for rank in range(RANKS):
                            clients[i].report(job_ids[i], result(rank, v))

                    list(pool.map(report_all, range(JOBS)))
                wait_for(lambda: all(store.version(j) == ROUNDS + 1 for j in job_ids), 30)

            for job_id in job_ids:
                journal = store.journal(job_id)
                assert [e.version for e in journal] == list(range(1, ROUNDS + 2))
                assert [e.observed_version for e in journal] == [None, *range(1, ROUNDS + 1)]
                updates = r.xrange(keys.job_updates(job_id))
                assert [int(f[b"version"]) for _, f in updates] == list(range(1, ROUNDS + 2))
                assert store.get_job(job_id).fields.get("error", "") == ""
            assert r.xlen(keys.DEADLETTER_STREAM) == 0
            # Both coordinators took part, and every entry was handled exactly once between them.
            # A coordinator acknowledges (and counts) a batch after the transaction that stored it
            # and enqueued the next version: a worker can publish that version first.
            expected = JOBS * (1 + RANKS) + JOBS * RANKS * ROUNDS

            def settled() -> bool:
                groups = r.xinfo_groups(keys.RESULTS_STREAM)
                counted = sum(c.processed for c in coordinators)
                return counted >= expected and all(g["pending"] == 0 for g in groups)

            wait_for(settled, 10, "the last batches' acknowledgements")
            handled = [c.processed for c in coordinators]
            assert min(handled) > 0, handled
            assert sum(handled) == expected, handled

            # rq counts a task after it returns, a moment after its version became visible.
            def done() -> int:
                return sum(w.successful_job_count for w in Worker.all(connection=r))

            wait_for(lambda: done() >= JOBS * (ROUNDS + 1), 10, "rq to count every task")
        finally:
            stop(workers)
