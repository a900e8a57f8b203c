"""Planner runs whose rq job died: told from rq's own records, and ended with the reason."""

from __future__ import annotations

import logging
from typing import Any

from protocol import keys

logger = logging.getLogger(__name__)

#: How long a finished or failed plan's progress hash stays in Redis, seconds.
PLAN_KEY_TTL = 30 * 24 * 3600
#: States of a run that has not ended; ``done`` and ``failed`` are its ends.
LIVE_STATES = ("queued", "running")

# Ends a run that has not ended yet; one that did (or whose record expired) keeps its record.
# KEYS[1] plan record, KEYS[2] active runs. ARGV[1] reason, ARGV[2] TTL, ARGV[3] plan id.
# Returns 1 ended, 0 not live.
_END = """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'queued' and state ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'failed', 'message', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[3])
return 1
"""

ABANDONED = "its worker died (rq: abandoned)"


def end_run(conn: Any, plan_id: str, reason: str) -> bool:
    """Mark a run that has not ended failed with ``reason``, to expire like any ended run.

    Returns:
        Whether it was ended here: False for a run that had ended (its own reason stands) or
        whose record is gone.
    """
    ended = conn.eval(
        _END, 2, keys.plan_key(plan_id), keys.PLANS_ACTIVE, reason, PLAN_KEY_TTL, plan_id
    )
    return bool(ended)


def expired_executions(conn: Any, queue: str = keys.RQ_QUEUE) -> list[str]:
    """The started rq tasks whose execution Redis let expire: their worker stopped beating.

    rq scores each entry of its StartedJobRegistry with the time its execution expires on the
    worker's clock, and its cleanup compares that with the caller's clock: a coordinator a few
    minutes ahead of a worker failed that worker's running tasks as abandoned. The execution's
    own key (``rq:execution:<job id>:<execution id>``) expires on Redis's clock, each
    heartbeat renewing it, so it tells a dead worker's task from a live one whatever the
    machines' clocks say.

    Args:
        conn: The Redis connection.
        queue: The rq queue whose started tasks to look at.

    Returns:
        The registry's entries (``<job id>:<execution id>``) whose execution key is gone.
    """
    from rq.executions import Execution
    from rq.registry import StartedJobRegistry
    from rq.utils import as_text, parse_composite_key

    started = StartedJobRegistry(queue, connection=conn)
    entries = [as_text(entry) for entry in conn.zrange(started.key, 0, -1)]
    if not entries:
        return []
    # One transaction: a task that ends meanwhile leaves the registry and deletes its
    # execution in one of rq's own, so it is seen either running or gone, never abandoned.
    with conn.pipeline(transaction=True) as pipe:
        for entry in entries:
            job_id, execution_id = parse_composite_key(entry)
            pipe.exists(Execution(execution_id, job_id, conn).key)
            pipe.zscore(started.key, entry)
        replies = pipe.execute()
    return [
        entry
        for entry, live, listed in zip(entries, replies[::2], replies[1::2], strict=True)
        if not live and listed is not None
    ]


def rq_death(conn: Any, plan_id: str) -> str | None:
    """Why rq says the run's job is dead, or None while rq may still run it (or finished it).

    Read-only (an operator without write access may ask). Dead: the rq job is gone, failed,
    stopped or canceled, or it is started while its execution expired in Redis
    (:func:`expired_executions`), the task rq's registry cleanup moves to the failed jobs as
    abandoned.

    Args:
        conn: redis-py client.
        plan_id: The run.
    """
    from rq.exceptions import InvalidJobOperation
    from rq.job import Job, JobStatus

    rq_id = keys.plan_rq_job(plan_id)
    job = Job(rq_id, connection=conn)
    try:
        status = job.get_status()
    except InvalidJobOperation:  # rq keeps no status: the job is gone
        return f"its rq job {rq_id} is gone from Redis"
    if status == JobStatus.FAILED:
        result = job.latest_result()
        text = (result.exc_string or "") if result is not None else ""
        if "AbandonedJobError" in text:
            return ABANDONED
        last = text.strip().splitlines()[-1] if text.strip() else "no reason recorded"
        return f"its rq job failed ({last})"
    if status in (JobStatus.STOPPED, JobStatus.CANCELED):
        return f"its rq job was {status.value}"
    if status == JobStatus.STARTED:
        if any(entry.startswith(f"{rq_id}:") for entry in expired_executions(conn)):
            return f"{ABANDONED}: no heartbeat from its worker"
    return None


def on_rq_failure(job: Any, connection: Any, exc_type: type, value: Any, tb: Any) -> None:
    """The failure callback of a planning job for rq: ends its run, e.g. its worker died.

    rq calls it where it notices the failure: in the worker for an error the run raised (the
    run recorded its own reason first, which stands), in whichever process runs rq's registry
    cleanup for a task whose worker died (``AbandonedJobError``).
    """
    from rq.exceptions import AbandonedJobError

    plan_id = job.kwargs.get("plan_id")
    if not plan_id:
        return
    if issubclass(exc_type, AbandonedJobError):
        reason = ABANDONED
    else:
        reason = f"{exc_type.__name__}: {value}"
    if end_run(connection, plan_id, reason):
        logger.warning("planner run %s: failed: %s", plan_id, reason)


def settle_runs(conn: Any, limit: int = 1000) -> list[tuple[str, str]]:
    """End the runs in ``keys.PLANS_ACTIVE`` whose rq job is dead (:func:`rq_death`).

    Forgets runs that ended or whose record is gone. Reads only the runs not ended (the
    oldest ``limit``), so its cost does not grow with past runs.

    Returns:
        ``(plan id, reason)`` of each run ended here.
    """
    ended = []
    for raw in conn.zrange(keys.PLANS_ACTIVE, 0, limit - 1):
        plan_id = raw.decode() if isinstance(raw, bytes) else str(raw)
        state = conn.hget(keys.plan_key(plan_id), "state")
        if (state.decode() if isinstance(state, bytes) else state) not in LIVE_STATES:
            conn.zrem(keys.PLANS_ACTIVE, plan_id)
            continue
        reason = rq_death(conn, plan_id)
        if reason is not None and end_run(conn, plan_id, reason):
            ended.append((plan_id, reason))
    return ended
