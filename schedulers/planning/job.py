"""Planning as an rq job: ``perseus optimize --enqueue``.

:func:`enqueue_planning` checks the arguments and queues :func:`run_planning_job` on the
perseus rq queue; the job reports progress and its outcome in the Redis hash
``keys.plan_key(plan_id)``. Watch it with ``redis-cli HGETALL perseus:plan:<plan_id>``. A run
whose rq job dies (its worker killed) is ended by :mod:`schedulers.planning.plan_runs`.

The planner's own core needs no lowtime (only ``--solver lowtime`` imports it), so rq workers
that import this module pay for scipy's import only, when a job fits its cost models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protocol import keys
from protocol.connection import connect
from protocol.exceptions import ConfigError
from protocol.pipeline_schedules import DEFAULT_SCHEDULE
from schedulers.planning.pipeline_dag import MAX_INSTRUCTIONS, PipelineShape, check_instructions
from schedulers.planning.plan_runs import PLAN_KEY_TTL
from schedulers.planning.planner import PLAN_FILES, SOLVERS, plan_frontier
from schedulers.planning.profile_csv import InstructionProfile, ProfileRow, build_profile

#: rq's default job timeout (180 s) is far too short for large pipelines.
PLAN_JOB_TIMEOUT = 24 * 3600
__all__ = ["PLAN_JOB_TIMEOUT", "PLAN_KEY_TTL", "enqueue_planning", "run_planning_job"]


def new_plan_id() -> str:
    """Return a readable, unique plan id (no ``:``, so it fits in key names)."""
    import secrets
    from datetime import datetime, timezone

    return f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def enqueue_planning(
    conn: Any,
    profile: InstructionProfile,
    num_stages: int,
    num_microbatches: int,
    *,
    out_dir: str | Path,
    p2p_power: float = 0.0,
    unit_time: float = 0.001,
    plot: bool = False,
    plan_id: str | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    solver: str = "auto",
    plans: str = "all",
    max_instructions: int = MAX_INSTRUCTIONS,
) -> str:
    """Enqueue :func:`run_planning_job` on the perseus rq queue and return the plan id.

    Arguments are checked here, so that mistakes surface before anything is queued. The
    profile travels inside the job (workers need not see the file); ``out_dir`` is made
    absolute and must be reachable by the workers.

    Progress and outcome: hash ``keys.plan_key(plan_id)`` with fields ``state`` (queued,
    running, done, failed), ``progress`` (0..1), ``message``, ``out_dir`` and ``num_plans``;
    the plan id is added to the sorted sets ``keys.PLANS_INDEX`` and, until it ends,
    ``keys.PLANS_ACTIVE`` (score: enqueue time). The record and the rq job are written in one
    transaction, so a reader never sees the one without the other.

    ``max_instructions`` bounds the pipeline's instructions (``2 * S * M``): a larger one is
    refused here, before anything is built or queued, and the job checks it again.

    Raises:
        ConfigError: Bad arguments, a pipeline of more than ``max_instructions``
            instructions, or a profile that does not cover the pipeline.

    """
    import time

    from rq import Callback, Queue

    check_instructions(num_stages, num_microbatches, max_instructions)
    if not unit_time > 0 or not p2p_power >= 0:
        raise ConfigError(f"need unit_time > 0 and p2p_power >= 0, got {unit_time}, {p2p_power}")
    if solver not in SOLVERS or plans not in PLAN_FILES:
        raise ConfigError(
            f"solver must be one of {', '.join(SOLVERS)} and plans one of "
            f"{', '.join(PLAN_FILES)}; got {solver!r}, {plans!r}"
        )
    profile.check_stages(num_stages)
    PipelineShape(num_stages, num_microbatches, schedule)  # Checks the shape and schedule.
    pid = plan_id or new_plan_id()
    out = str(Path(out_dir).resolve())
    rows = [
        (s, i, f, t, e)
        for (s, i), tab in sorted(profile.table.items())
        for f, (t, e) in sorted(tab.items(), reverse=True)
    ]
    key = keys.plan_key(pid)
    fields = {
        "state": "queued",
        "progress": 0.0,
        "message": "queued",
        "out_dir": out,
        "num_plans": 0,
        "profile": profile.path,
        "num_stages": num_stages,
        "num_microbatches": num_microbatches,
        "schedule": schedule,
        "unit_time": unit_time,
        "p2p_power": p2p_power,
    }
    # rq starts the transaction (MULTI) on a pipeline that holds nothing yet: it goes first.
    pipe = conn.pipeline()
    Queue(keys.RQ_QUEUE, connection=conn).enqueue(
        "schedulers.planning.job.run_planning_job",
        kwargs={
            "plan_id": pid,
            "rows": rows,
            "num_stages": num_stages,
            "num_microbatches": num_microbatches,
            "out_dir": out,
            "p2p_power": p2p_power,
            "unit_time": unit_time,
            "profile_path": profile.path,
            "plot": plot,
            "schedule": schedule,
            "solver": solver,
            "plans": plans,
            "max_instructions": max_instructions,
        },
        job_timeout=PLAN_JOB_TIMEOUT,
        job_id=keys.plan_rq_job(pid),
        description=f"perseus plan {pid}: {num_stages}x{num_microbatches} {schedule} -> {out}",
        # rq calls it also where it finds the task abandoned by a dead worker.
        on_failure=Callback("schedulers.planning.plan_runs.on_rq_failure"),
        pipeline=pipe,
    )
    pipe.hset(key, mapping=fields)
    queued_at = time.time()
    pipe.zadd(keys.PLANS_INDEX, {pid: queued_at})
    pipe.zadd(keys.PLANS_ACTIVE, {pid: queued_at})
    pipe.execute()
    return pid


def run_planning_job(
    plan_id: str,
    rows: list[tuple[int, str, int, float, float]],
    num_stages: int,
    num_microbatches: int,
    out_dir: str,
    p2p_power: float = 0.0,
    unit_time: float = 0.001,
    profile_path: str = "",
    plot: bool = False,
    redis_url: str | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    solver: str = "auto",
    plans: str = "all",
    max_instructions: int = MAX_INSTRUCTIONS,
) -> dict[str, Any]:
    """Run :func:`~schedulers.planning.planner.plan_frontier` as an rq job; progress goes to Redis.

    The solver is the planner's own core (``solver="auto"``: compiled if built, else pure
    Python), so a worker needs lowtime only for ``solver="lowtime"``.

    Progress goes to the hash ``keys.plan_key(plan_id)`` (see :func:`enqueue_planning`).

    Uses the worker's Redis connection (or ``redis_url`` when called outside rq).

    Returns:
        ``{"plan_id", "out_dir", "num_plans"}``.

    """
    from rq import get_current_job

    job = get_current_job()
    conn: Any  # redis-py's stubs reject plain str-keyed mappings in hset
    if redis_url is not None:
        conn = connect(redis_url)
    elif job is not None:
        conn = job.connection
    else:
        raise ConfigError("run_planning_job needs redis_url when not run by an rq worker")
    import time

    key = keys.plan_key(plan_id)
    pipe = conn.pipeline()
    pipe.hset(key, mapping={"state": "running", "message": "starting", "out_dir": out_dir})
    # A run that had ended and runs again (`rq requeue`): live again, so the sweep watches it
    # and its record does not expire while it runs.
    pipe.persist(key)
    pipe.zadd(keys.PLANS_ACTIVE, {plan_id: time.time()}, nx=True)
    pipe.execute()
    last = [-1.0]

    def report(fraction: float, message: str) -> None:
        # Every half percent is enough to watch, and bounds the writes to ~200.
        if fraction - last[0] >= 0.005 or fraction >= 1.0:
            conn.hset(key, mapping={"progress": round(fraction, 4), "message": message})
            last[0] = fraction

    try:
        profile = build_profile([ProfileRow(*row) for row in rows], path=profile_path)
        result = plan_frontier(
            profile,
            num_stages,
            num_microbatches,
            out_dir=out_dir,
            p2p_power=p2p_power,
            unit_time=unit_time,
            progress=report,
            schedule=schedule,
            solver=solver,
            plans=plans,
            max_instructions=max_instructions,
        )
        if plot:
            from schedulers.planning.plots import plot_run  # matplotlib: only when plotting

            plot_run(result.out_dir)
    except Exception as exc:
        _end(conn, plan_id, {"state": "failed", "message": f"{type(exc).__name__}: {exc}"})
        raise
    done = {
        "state": "done",
        "progress": 1.0,
        "num_plans": len(result.points),
        "message": f"{len(result.points)} plans written to {result.out_dir}",
    }
    _end(conn, plan_id, done)
    return {"plan_id": plan_id, "out_dir": str(result.out_dir), "num_plans": len(result.points)}


def _end(conn: Any, plan_id: str, fields: dict[str, Any]) -> None:
    """Record a run's end: its outcome, its record's expiry, and no more in the active runs."""
    pipe = conn.pipeline()
    pipe.hset(keys.plan_key(plan_id), mapping=fields)
    pipe.expire(keys.plan_key(plan_id), PLAN_KEY_TTL)
    pipe.zrem(keys.PLANS_ACTIVE, plan_id)
    pipe.execute()
