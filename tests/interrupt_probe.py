"""Run by tests/test_suite_signals.py (not collected alone): Ctrl-C after an rq worker ran here.

Usage: python -m pytest tests/interrupt_probe.py. The first test runs an rq worker in this
process, as tests of the worker path do; the second sends this process the SIGINT of a Ctrl-C.
The run must stop there as interrupted, not go on.
"""

from __future__ import annotations

import os
import signal
import time

import redis
from rq import Queue, SimpleWorker


def test_an_rq_worker_runs_in_this_process(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    SimpleWorker([Queue("probe", connection=conn)], connection=conn).work(burst=True)


def test_ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(10)  # a KeyboardInterrupt ends this at once


def test_after_ctrl_c() -> None:
    print("RAN AFTER CTRL-C")
