"""Planning as an rq job: ``perseus optimize --enqueue``.

:func:`enqueue_planning` checks the arguments and queues :func:`run_planning_job` on the
perseus rq queue; the job reports progress and its outcome in the Redis hash
``keys.plan_key(plan_id)``. Watch it with ``redis-cli HGETALL perseus:plan:<plan_id>``.

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
from schedulers.planning.pipeline_dag import PipelineShape
from schedulers.planning.planner import PLAN_FILES, SOLVERS, plan_frontier
from schedulers.planning.profile_csv import InstructionProfile, ProfileRow, build_profile

#: rq's default job timeout (180 s) is far too short for large pipelines.
PLAN_JOB_TIMEOUT = 24 * 3600
#: How long a finished or failed plan's progress hash stays in Redis, seconds.
PLAN_KEY_TTL = 30 * 24 * 3600


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
) -> str:
    """Enqueue :func:`run_planning_job` on the perseus rq queue and return the plan id.

    Arguments are checked here, so that mistakes surface before anything is queued. The
    profile travels inside the job (workers need not see the file); ``out_dir`` is made
    absolute and must be reachable by the workers.

    Progress and outcome: hash ``keys.plan_key(plan_id)`` with fields ``state`` (queued,
    running, done, failed), ``progress`` (0..1), ``message``, ``out_dir`` and ``num_plans``;
    the plan id is added to the sorted set ``keys.PLANS_INDEX`` (score: enqueue time).

    Raises:
        ConfigError: Bad arguments or a profile that does not cover the pipeline.

    """
    import time

    from rq import Queue

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
    pipe = conn.pipeline()
    pipe.hset(key, mapping=fields)
    pipe.zadd(keys.PLANS_INDEX, {pid: time.time()})
    pipe.execute()
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
        },
        job_timeout=PLAN_JOB_TIMEOUT,
        job_id=f"perseus-plan-{pid}",
        description=f"perseus plan {pid}: {num_stages}x{num_microbatches} {schedule} -> {out}",
    )
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
    key = keys.plan_key(plan_id)
    conn.hset(key, mapping={"state": "running", "message": "starting", "out_dir": out_dir})
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
        )
        if plot:
            from schedulers.planning.plots import plot_run  # matplotlib: only when plotting

            plot_run(result.out_dir)
    except Exception as exc:
        conn.hset(key, mapping={"state": "failed", "message": f"{type(exc).__name__}: {exc}"})
        conn.expire(key, PLAN_KEY_TTL)
        raise
    done = {
        "state": "done",
        "progress": 1.0,
        "num_plans": len(result.points),
        "message": f"{len(result.points)} plans written to {result.out_dir}",
    }
    conn.hset(key, mapping=done)
    conn.expire(key, PLAN_KEY_TTL)
    return {"plan_id": plan_id, "out_dir": str(result.out_dir), "num_plans": len(result.points)}
