"""`rq suspend` with `perseus worker`: a task that arrives meanwhile waits for `rq resume`.

rq checks for suspension only before it waits for a task: a worker already waiting (every
idle worker) took the next task and ran it, so a job got a new version while `perseus
status` said none would come.
"""

from __future__ import annotations

import pytest
from rq import Queue, Worker
from rq.suspension import resume, suspend

from coordinator.advance_queue import enqueue
from protocol import keys
from protocol.store import JobStore
from tests.helpers import STEPDOWN, make_settings, new_job, start_perseus, stop, wait_for


def _worker_state(conn: object) -> str:
    workers = Worker.all(connection=conn)  # type: ignore[arg-type]
    return workers[0].get_state() if len(workers) == 1 else ""


@pytest.mark.parametrize("mode", [[], ["--fork"]], ids=["long-lived", "fork"])
def test_a_task_enqueued_while_suspended_waits_for_resume(r, redis_url, tmp_path, mode):
    store = JobStore(r)
    new_job(store, "held", STEPDOWN)
    worker = start_perseus(["worker", "--redis-url", redis_url, *mode], tmp_path, "worker.log")
    try:
        # Idle: waiting for a task, past rq's check for suspension.
        wait_for(lambda: _worker_state(r) == "idle", 30, "the worker to wait for a task")
        suspend(r)
        task = enqueue(Queue(keys.RQ_QUEUE, connection=r), store, make_settings(redis_url), "held")
        wait_for(lambda: _worker_state(r) == "suspended", 30, "the worker to see the suspension")
        assert store.version("held") == 0
        assert task.get_status(refresh=True) == "queued"
        assert r.lrange(Queue(keys.RQ_QUEUE, connection=r).key, 0, -1) == [task.id.encode()]
        resume(r)
        wait_for(lambda: store.version("held") == 1, 30, "version 1 after rq resume")
        wait_for(lambda: task.get_status(refresh=True) == "finished", 10, "the task to finish")
    finally:
        resume(r)
        stop([worker])
    log = (tmp_path / "worker.log").read_text()
    assert "Traceback" not in log, log
