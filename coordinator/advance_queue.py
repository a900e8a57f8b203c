"""Scheduler work on rq: the task that advances a job, alone or in a caller's transaction."""

from __future__ import annotations

import uuid

from redis.client import Pipeline
from rq import Queue
from rq.job import Job

from coordinator.settings import PerseusSettings
from protocol.store import JobStore

RESULT_TTL_S = 60
"""How long rq keeps a finished task (its hash and result stream, about 6.5 kB): for ``rq info``
and the sweep's look at it. Nothing reads the result later; a job that publishes a version
per second thus keeps about 0.4 MB of them, not the 4 MB of rq's default 600 s."""


def enqueue(
    queue: Queue,
    store: JobStore,
    settings: PerseusSettings,
    job_id: str,
    pipeline: Pipeline | None = None,
    record: bool = True,
    task_id: str | None = None,
) -> Job:
    """Enqueue the rq task that computes ``job_id``'s next schedule version.

    Args:
        queue: The scheduler queue.
        store: The job store (``record`` writes to the job).
        settings: Stall timeout (the task's lease), job timeout, snapshot interval, and the
            updates streams' cap (the worker publishes with the coordinator's).
        job_id: The job.
        pipeline: A transaction in explicit MULTI mode: the enqueue happens when the caller
            executes it (default: now, in a transaction of its own).
        record: Also note the rq task and the time on the job (what the sweep checks);
            otherwise the caller does, with :func:`record_enqueued` (or the results script,
            see :meth:`protocol.store_batch.StoreBatch.note_task`).
        task_id: The rq task's id (default: a new one, :func:`new_task_id`).
    """
    lease_ms = max(1000, int(settings.stall_timeout * 1000))
    pipe = pipeline
    if pipe is None:
        pipe = store.conn.pipeline(transaction=True)
        pipe.multi()
    job = queue.enqueue_call(
        "coordinator.tasks.advance_job",
        args=(job_id, lease_ms),
        kwargs={"snapshot_every": settings.snapshot_every, "stream_maxlen": settings.stream_maxlen},
        description=f"advance {job_id}",
        timeout=settings.job_timeout,
        result_ttl=RESULT_TTL_S,
        failure_ttl=24 * 3600,
        pipeline=pipe,
        job_id=task_id or new_task_id(),
    )
    if record:
        record_enqueued(store, job_id, job.id, pipe)
    if pipeline is None:
        pipe.execute()
        pipe.reset()
    return job


def new_task_id() -> str:
    """A fresh rq task id, of the kind rq makes itself (a UUID4)."""
    return str(uuid.uuid4())


def record_enqueued(store: JobStore, job_id: str, rq_job: str, pipe: Pipeline) -> None:
    """Note on the job which rq task advances it and when it was enqueued (server clock)."""
    store.set_fields(job_id, pipeline=pipe, enqueued_at=f"{store.clock.now():.3f}", rq_job=rq_job)
