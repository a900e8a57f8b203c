"""`rq requeue` of a failed advance task, as an rq user would run it once the cause is mended."""

from __future__ import annotations

import subprocess
import sys

from rq import Queue

from coordinator.service import Coordinator
from protocol import keys
from protocol.store import JobStore
from tests.helpers import make_settings, register, result, running, start_perseus, stop, wait_for
from worker_client.hook.session import CoordinatorClient


def test_a_requeued_task_that_succeeds_clears_the_jobs_failure(r, redis_url, tmp_path):
    """A converged job whose task failed stayed `failed` after its requeued task succeeded.

    Only a new version cleared the error; a converged scheduler records an observation without
    one, so `perseus status` and `perseus jobs list` kept showing the job failed.
    """
    flag = tmp_path / "flag"
    settings = make_settings(
        redis_url, "tests.toy_schedulers:FailsWhileFlagged", scheduler_args={"flag": str(flag)}
    )
    coord = Coordinator(r, settings)
    with running(coord):
        worker = start_perseus(["worker", "--redis-url", redis_url], tmp_path, "worker.log")
        store, failed = JobStore(r), Queue(keys.RQ_QUEUE, connection=r).failed_job_registry
        try:
            client = CoordinatorClient(redis_url)
            job_id = register(client)
            wait_for(lambda: store.version(job_id) == 1, 30, "version 1")
            flag.touch()
            for rank in range(2):
                client.report(job_id, result(rank, 1))
            wait_for(lambda: failed.get_job_ids(), 30, "the task to fail")
            assert "is in the way" in store.job_error(job_id)
            flag.unlink()
            requeue = [sys.executable, "-m", "rq.cli", "requeue", "-u", redis_url]
            subprocess.run([*requeue, "--queue", keys.RQ_QUEUE, "--all"], check=True, timeout=60)
            wait_for(lambda: len(store.journal(job_id)) == 2, 30, "the observation recorded")
            assert store.job_error(job_id) == ""
            assert store.version(job_id) == 1 and failed.get_job_ids() == []
        finally:
            stop([worker])
