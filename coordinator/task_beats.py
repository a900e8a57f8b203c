"""rq's heartbeats of a long-lived worker's task, sent from a thread while the task runs."""

from __future__ import annotations

import logging
import threading

import redis
from rq import Worker
from rq.executions import Execution
from rq.job import Job

logger = logging.getLogger(__name__)


class TaskBeats:
    """rq's heartbeats of the task at hand, sent from a thread while the task runs.

    rq's forking worker sends them from its main process every ``job_monitoring_interval``
    (30 s), each good for a minute more; its SimpleWorker sends none during a task, so it
    registers the task's execution for the task's whole time-out (an hour for an advance task,
    a day for a planning one). A long-lived worker killed during a task then stayed "started"
    in rq's StartedJobRegistry, and registered as a live worker, that long. With these beats
    rq's registry cleanup finds the task abandoned a minute and a half after its worker died.
    One thread per worker, idle between tasks: a task's start and end only swap a reference.
    """

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._lock = threading.Lock()  # a beat never lands after its task ended
        self._task: tuple[Job, Execution] | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, job: Job, execution: Execution) -> None:
        """Beat for ``job`` until :meth:`stop`."""
        with self._lock:
            self._task = (job, execution)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rq-task-beats", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """No more beats for the task that ran (the worker's own heartbeat follows)."""
        with self._lock:
            self._task = None

    def close(self) -> None:
        """End the thread (the worker is tearing down)."""
        self.stop()
        self._closed.set()

    def _run(self) -> None:
        interval = float(self._worker.job_monitoring_interval)
        wait = interval
        while not self._closed.wait(wait):
            wait = interval
            with self._lock:
                if self._task is None:
                    continue
                try:
                    self._worker.maintain_heartbeats(*self._task)
                except redis.RedisError as exc:
                    # Again soon: the beat before this one is good for a minute.
                    logger.debug("rq worker %s: task heartbeat failed: %s", self._worker.name, exc)
                    wait = 1.0
