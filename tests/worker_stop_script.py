"""Run by tests/test_outage.py: a SIGTERM that lands inside one of rq's log calls.

rq stops an idle worker by raising StopRequested from its signal handler; raised inside a log
call, logging swallows it. Here a log handler sends the signal while rq logs the task it took.
Usage: python -m tests.worker_stop_script REDIS_URL
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import redis
from rq import Queue

from coordinator.worker_loop import PerseusSimpleWorker, run_workers


class SignalWhileLogging(logging.Handler):
    """Sends this process SIGTERM from inside the log call of the first task taken."""

    sent = False

    def emit(self, record: logging.LogRecord) -> None:
        # As logging's own handlers do: an error while emitting is reported, not raised.
        try:
            if not self.sent and "take-me" in record.getMessage():
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)  # rq's handler runs here and raises
        except Exception:
            self.handleError(record)


def main() -> None:
    conn = redis.Redis.from_url(sys.argv[1])
    queue = Queue("stopcheck", connection=conn)
    queue.enqueue("os.getpid", description="take-me")
    logging.getLogger("rq.worker").addHandler(SignalWhileLogging())
    restarts = run_workers(
        lambda: PerseusSimpleWorker([queue], connection=conn, name="stopcheck"),
        burst=False,
        logging_level="INFO",
    )
    print(f"stopped after {restarts} restarts; tasks done: {queue.finished_job_registry.count}")


if __name__ == "__main__":
    main()
