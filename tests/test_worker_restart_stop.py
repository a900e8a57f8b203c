"""A stop asked for while `perseus worker` starts a fresh rq worker after an outage.

Between the wait for Redis and rq's work loop (which installs rq's own signal handlers), a
SIGTERM or Ctrl-C reaches :func:`coordinator.worker_loop.run_workers`'s handler. It only set an
event that nobody looked at any more: the fresh worker went on taking tasks until it was
killed.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import redis
from rq import Queue

from coordinator.worker_loop import PerseusSimpleWorker, run_workers
from tests.helpers import start_perseus, stop, wait_for


@pytest.mark.parametrize("when", ["made", "bootstrap"])
def test_a_stop_while_the_next_worker_starts_stops_it(redis_url, when):
    conn = redis.Redis.from_url(redis_url)
    queue = Queue("restartstop", connection=conn)
    task = queue.enqueue("os.getpid")
    made: list[PerseusSimpleWorker] = []

    class QuitsOnce(PerseusSimpleWorker):
        def work(self, *args: Any, **kw: Any) -> bool:
            if self is made[0]:  # its work loop ends on an outage
                raise redis.ConnectionError("Redis went away")
            # Not stopped, it would serve for ever: a few idle seconds end the test as well.
            return bool(super().work(*args, max_idle_time=3, **kw))

        def bootstrap(self, *args: Any, **kw: Any) -> None:
            if when == "bootstrap":  # in work(), before rq installs its handlers
                os.kill(os.getpid(), signal.SIGTERM)
            super().bootstrap(*args, **kw)

    def make() -> PerseusSimpleWorker:
        if made and when == "made":
            os.kill(os.getpid(), signal.SIGTERM)
        made.append(QuitsOnce([queue], connection=conn, name="restartstop"))
        return made[-1]

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        restarts = run_workers(make)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert restarts == 1
    assert len(made) == 2
    assert queue.count == 1 and task.get_status() == "queued"  # the stopped worker took none


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_before_the_first_worker_installs_rqs_handlers_stops_it(redis_url, sig):
    # The first worker had only Python's defaults until rq's work() installed its handlers:
    # a SIGTERM (or a SIGHUP, forwarded to it) in between killed the process outright.
    conn = redis.Redis.from_url(redis_url)
    queue = Queue("firststop", connection=conn)
    task = queue.enqueue("os.getpid")

    class SignalledAtBootstrap(PerseusSimpleWorker):
        def bootstrap(self, *args: Any, **kw: Any) -> None:
            os.kill(os.getpid(), sig)  # registered with rq, its handlers not installed yet
            super().bootstrap(*args, **kw)

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        restarts = run_workers(lambda: SignalledAtBootstrap([queue], connection=conn))
        assert {s: signal.getsignal(s) for s in before} == before  # the caller's, back
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    assert restarts == 0
    assert queue.count == 1 and task.get_status() == "queued"  # stopped before taking it


@pytest.mark.parametrize("simple", [False, True], ids=["long-lived", "simple"])
def test_a_hangup_stops_perseus_worker_as_sigterm_does(redis_url, tmp_path, simple):
    # The terminal closed: Python's default for SIGHUP ended the worker at once, its record
    # left in rq's registry (counted by `rq info` and `perseus status` for a while).
    conn = redis.Redis.from_url(redis_url)
    args = ["worker", "--redis-url", redis_url, *(["--simple"] if simple else [])]
    proc = start_perseus(args, tmp_path, "worker.log")
    try:
        wait_for(lambda: conn.scard("rq:workers") == 1, 30, "the rq worker to register")
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=15) == 0, (tmp_path / "worker.log").read_text()[-2000:]
    finally:
        stop([proc])
    assert conn.scard("rq:workers") == 0
