"""A snapshot of everything perseus-mq keeps in Redis, for ``perseus status``."""

from __future__ import annotations

from typing import Any

import redis
from rq import Queue, worker_registration
from rq.suspension import WORKERS_SUSPENDED

from protocol import keys, streams
from protocol.exceptions import PerseusError, UnknownJobError
from protocol.job_lifecycle import Ending, JobLifecycle
from protocol.job_record import JobRecord, wrong_type
from protocol.models import ProfilingResult
from protocol.rank_lists import few_ranks
from protocol.store import JobStore
from schedulers.planning.plan_runs import LIVE_STATES, rq_death


def _stream_info(conn: redis.Redis, stream: str, lost: dict[str, int]) -> dict[str, Any]:
    info: dict[str, Any] = {"stream": stream, "length": int(conn.xlen(stream))}
    if stream in lost:
        info["lost"] = lost[stream]  # entries removed before the coordinators processed them
    try:
        groups = conn.xinfo_groups(stream)
    except redis.ResponseError:  # Stream does not exist yet.
        groups = []
    for group in groups:
        if group["name"] in (keys.COORDINATOR_GROUP, keys.COORDINATOR_GROUP.encode()):
            info["pending"] = int(group["pending"])
            info["consumers"] = int(group["consumers"])
            delivered = group["last-delivered-id"]
            # Redis 7 reports the lag itself; on 6.2, count entries after the last delivered.
            lag = group.get("lag")
            if lag is None:
                lag = len(conn.xrange(stream, min=f"({_text(delivered)}", max="+", count=10_000))
            info["lag"] = int(lag)
            # Not "last delivered == newest entry": a stream the sweep trimmed empty has none.
            info["caught_up"] = info["lag"] == 0
    return info


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


SILENT_AFTER_S = 180.0
"""A rank not heard from for this long is silent (three of the hook's default heartbeats)."""


def snapshot(conn: redis.Redis, silent_after: float = SILENT_AFTER_S) -> dict[str, Any]:
    """Jobs, their progress and ranks' liveness, stream lag and rq queue state."""
    store = JobStore(conn)
    now = store.server_time()  # heartbeats and activity stamps are the server's clock
    listed = store.list_jobs()
    endings = JobLifecycle(store).endings(job_id for job_id, _ in listed)
    jobs, unreadable = [], []
    for job_id, last_active in listed:
        try:
            job = _job(store, job_id, now - last_active, now, silent_after, endings[job_id])
        except UnknownJobError:
            continue  # Deleted while we looked.
        except (PerseusError, redis.ResponseError) as exc:
            if isinstance(exc, redis.ResponseError) and not wrong_type(exc):
                raise
            # Keys someone else overwrote (on Redis 6.2 ranks may): named, not hidden.
            unreadable.append({"job_id": job_id, "problem": str(exc)})
            continue
        jobs.append(job)
    queue = Queue(keys.RQ_QUEUE, connection=conn)
    lost = streams.lost_counts(conn)
    return {
        "jobs": jobs,
        "unreadable": unreadable,
        "plans": _planner_runs(conn),
        "streams": [
            _stream_info(conn, s, lost) for s in (*keys.INPUT_STREAMS, keys.DEADLETTER_STREAM)
        ],
        # Counted without rq's cleanups (which write), so that a read-only operator can look.
        "rq": {
            "queue": keys.RQ_QUEUE,
            "queued": queue.count,
            "workers": _live_workers(conn, queue),
            "failed": queue.failed_job_registry.get_job_count(cleanup=False),
            # `rq suspend`: `perseus worker`s take no task (coordinator.worker_suspend), so no
            # job gets a new version meanwhile, but from a task already running.
            # rq's is_suspended sends a MULTI, which a read-only operator may not.
            "suspended": bool(conn.exists(WORKERS_SUSPENDED)),
        },
    }


def _job(
    store: JobStore, job_id: str, idle_s: float, now: float, silent_after: float, ending: Ending
) -> dict[str, Any]:
    """One job's row of :func:`snapshot`."""
    record = store.get_job(job_id)
    version = store.version(job_id)
    world = record.info.world_size
    summaries = store.summaries(job_id) if version else {}
    first = _figures(store, job_id, 1, world, summaries) if version else None
    # The newest version all ranks reported for (the latest one may still be running).
    latest = None
    for v in (version, version - 1):
        if v > 1 and latest is None:
            latest = _figures(store, job_id, v, world, summaries)
    return {
        "job_id": job_id,
        "scheduler": record.config.scheduler,
        "ranks": store.rank_count(job_id),
        "world_size": record.info.world_size,
        "version": version,
        "results_for_version": store.result_count(job_id, version) if version else 0,
        "idle_s": round(idle_s, 1),
        "error": record.error,
        "first": first,
        "latest": latest,
        "ranks_finished": ending.ranks_finished,
        "finished_at": ending.finished_at,
        **_liveness(store, record, version, now, silent_after, ending),
    }


def _live_workers(conn: redis.Redis, queue: Queue) -> int:
    """The queue's workers whose rq record still exists.

    A worker killed with SIGKILL stays in rq's worker sets after its record expired, until a
    worker's registry maintenance (every 10 minutes) drops it: counted only while it has one,
    as `rq info` counts. One round trip, no MULTI (a read-only operator may not).
    """
    names = sorted(worker_registration.get_keys(queue=queue))
    if not names:
        return 0
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.exists(name)
        return sum(bool(n) for n in pipe.execute())


def _liveness(
    store: JobStore,
    record: JobRecord,
    version: int,
    now: float,
    silent_after: float,
    ending: Ending,
) -> dict[str, Any]:
    """Ranks heard from lately, silent ranks, and whether the job waits on silent ones.

    A job is ``finished`` when every rank's hook closed (or an operator finished it); it is
    ``stalled`` when its version still lacks results from a silent rank: no new version will
    come until that rank reports (or the job is restarted), whatever the live ranks do (a
    survivor stuck in a collective beats on but never reports).
    """
    job_id, world = record.job_id, record.info.world_size
    heard = store.ranks_heard(job_id)
    # A rank never heard from (it died before its hook's first heartbeat, inside the hook's
    # constructor, say) counts from its job's creation: silent, not alive for ever.
    created = float(record.fields.get("created_at") or record.fields.get("active_at") or now)
    silent = [r for r in range(world) if now - heard.get(r, created) > silent_after]
    reported = set(store.reported_ranks(job_id, version)) if version else set()
    quiet = {r for r in silent if r not in reported}
    # A rank whose hook closed sends no more results: waited on from then on, silent or not.
    finished = ending.ranks_finished and version
    closed = JobLifecycle(store).finished_ranks(job_id) if finished else []
    # Sets, not lists: looked up once per closed rank (a list was quadratic: 30,000 ranks 3 s).
    waiting = sorted(quiet | {r for r in closed if r not in reported})
    stalled = bool(version and waiting)
    if ending.finished:
        state, stalled = "finished", False
    elif record.error:
        state = "failed"
    else:
        state = "stalled" if stalled else "running" if version else "starting"
    return {
        "alive": world - len(silent),
        "silent_ranks": silent,
        "closed_ranks": closed,
        "state": state,
        "waiting_on": waiting if stalled else [],
    }


def _figures(
    store: JobStore, job_id: str, version: int, world_size: int, summaries: dict[int, Any]
) -> dict[str, float] | None:
    """A version's time and energy per iteration, from its results or their summary.

    A scheduler snapshot deletes the results it consumed; their summary has the same figures.
    """
    summary = summaries.get(version)
    if summary is None or store.result_count(job_id, version):
        return _iteration_figures(store.results(job_id, version), world_size)
    if summary["ranks"] < world_size or summary["iter_time"] is None:
        return None
    return {
        "version": version,
        "time_s": summary["iter_time"],
        "energy_j": summary["iter_energy"],
    }


def _iteration_figures(results: list[ProfilingResult], world_size: int) -> dict[str, float] | None:
    """A version's time and energy per iteration (all ranks reported), or None.

    Ranks run in lockstep, so the job's iteration takes the slowest rank's time and the sum of
    every rank's energy.
    """
    if len(results) < world_size or not all(r.iter_time and r.iter_energy for r in results):
        return None
    return {
        "version": results[0].schedule_version,
        "time_s": max(sum(r.iter_time) / len(r.iter_time) for r in results),
        "energy_j": sum(sum(r.iter_energy) / len(r.iter_energy) for r in results),
    }


def _savings(job: dict[str, Any]) -> str:
    """``latest J/iter (v1 -> vN: -x% energy, +y% time)``, or what is missing."""
    first, latest = job.get("first"), job.get("latest")
    if first is None:
        return "-"
    if first["energy_j"] <= 0:  # Dry-run or simulated clocks without an energy source.
        if latest is None or latest["version"] == first["version"] or first["time_s"] <= 0:
            return f"{first['time_s']:.4f} s/it, no energy measured (v1)"
        slower = latest["time_s"] / first["time_s"] - 1
        return (
            f"{latest['time_s']:.4f} s/it v{latest['version']}: {slower:+.1%} time vs v1, "
            "no energy measured"
        )
    if latest is None or not (first["energy_j"] > 0 and first["time_s"] > 0):
        return f"{first['energy_j']:.1f} J/it (v1)"
    energy = latest["energy_j"] / first["energy_j"] - 1
    slower = latest["time_s"] / first["time_s"] - 1
    return (
        f"{latest['energy_j']:.1f} J/it v{latest['version']}: {energy:+.1%} energy, "
        f"{slower:+.1%} time vs v1"
    )


def _planner_runs(conn: redis.Redis, limit: int = 20) -> list[dict[str, Any]]:
    """The newest ``perseus optimize --enqueue`` runs (``perseus:plans``), newest first."""
    runs = []
    for raw_id, _queued_at in conn.zrevrange(keys.PLANS_INDEX, 0, limit - 1, withscores=True):
        plan_id = _text(raw_id)
        fields = {_text(k): _text(v) for k, v in conn.hgetall(keys.plan_key(plan_id)).items()}
        # The state hash expires after a while; the index entry says it existed.
        state, message = fields.get("state", "expired"), fields.get("message", "")
        if state in LIVE_STATES and (reason := rq_death(conn, plan_id)) is not None:
            # Its worker died (or its rq job went): failed, whether or not a coordinator's
            # sweep has recorded it yet (this command writes nothing).
            state, message = "failed", reason
        runs.append(
            {
                "plan_id": plan_id,
                "state": state,
                "progress": float(fields.get("progress", 0.0)),
                "message": message,
            }
        )
    return runs


def format_snapshot(snap: dict[str, Any]) -> str:
    """Human-readable tables of :func:`snapshot`."""
    unreadable = snap.get("unreadable", [])
    lines = [
        f"jobs: {len(snap['jobs'])}" + (f" (+{len(unreadable)} unreadable)" if unreadable else "")
    ]
    if snap["jobs"]:
        width = max(len("JOB ID"), *(len(job["job_id"]) for job in snap["jobs"]))
        lines.append(
            f"  {'JOB ID':<{width}} {'RANKS':>7} {'ALIVE':>7} {'VER':>4} {'RESULTS':>8} "
            f"{'IDLE s':>8}  STATE / ENERGY PER ITERATION / ERROR"
        )
        for job in snap["jobs"]:
            if job["state"] == "stalled":
                # A few of each kind named (--json lists every one): 100,000 made 600 kB.
                closed = set(job.get("closed_ranks", []))
                silent = [r for r in job["waiting_on"] if r not in closed]
                gone = [r for r in job["waiting_on"] if r in closed]
                parts = [f"silent ranks {few_ranks(silent)}"] if silent else []
                parts += [f"ranks {few_ranks(gone)} whose hook closed"] if gone else []
                detail = f"stalled: waiting on {' and '.join(parts)}"
            elif job["state"] == "failed":
                detail = f"failed: {job['error']}"
            else:  # The state word first: the same as `perseus jobs list` and --json.
                detail = f"{job['state']}: {_savings(job)}"
            lines.append(
                f"  {job['job_id']:<{width}} {job['ranks']:>3}/{job['world_size']:<3} "
                f"{job['alive']:>3}/{job['world_size']:<3} "
                f"{job['version']:>4} {job['results_for_version']:>4}/{job['world_size']:<3} "
                f"{job['idle_s']:>8}  {detail}"
            )
    for job in unreadable:
        lines.append(f"  {job['job_id']}  UNREADABLE: {job['problem']}")
    if snap.get("plans"):
        lines.append(f"planner runs: {len(snap['plans'])}")
        for run in snap["plans"]:
            lines.append(
                f"  {run['plan_id']:<40} {run['state']:<8} {run['progress']:>6.1%}  "
                f"{run['message']}"
            )
    lines.append("streams:")
    for s in snap["streams"]:
        extra = ""
        if "pending" in s:
            extra = f" pending={s['pending']} lag={s['lag']} consumers={s['consumers']}"
        if s.get("lost"):
            extra += f" LOST={s['lost']} (removed unread: see the coordinator's log)"
        lines.append(f"  {s['stream']:<32} length={s['length']}{extra}")
    rq = snap["rq"]
    held = "  SUSPENDED (`rq suspend`): no new versions until `rq resume`"
    lines.append(
        f"rq queue '{rq['queue']}': queued={rq['queued']} workers={rq['workers']} "
        f"failed={rq['failed']}" + (held if rq.get("suspended") else "")
    )
    return "\n".join(lines)
