"""``perseus jobs``: list jobs with their state, delete one, mark one finished."""

from __future__ import annotations

import json
from typing import Any

import click

from coordinator.cli_common import connect_settings
from protocol import keys
from protocol.cli_options import redis_url_option
from protocol.exceptions import ProtocolError
from protocol.job_lifecycle import JobLifecycle
from protocol.job_record import parse_version, unknown_job
from protocol.store import JobStore


def job_rows(store: JobStore) -> list[dict[str, Any]]:
    """Every job: id, state, world size, version, age, idle time and ranks finished.

    A few round trips whatever the number of jobs; times are the Redis server's.
    """
    now = store.server_time()
    listed = store.list_jobs()
    ids = [job_id for job_id, _ in listed]
    problems: dict[str, str] = {}
    records = store.get_jobs(ids, problems)
    with store.conn.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.get(keys.job_version(job_id))
        versions = []
        for job_id, raw in zip(ids, pipe.execute(raise_on_error=False), strict=True):
            try:
                if isinstance(raw, Exception):
                    raise ProtocolError(f"job {job_id}: its version key: {raw}")
                versions.append(parse_version(job_id, raw))
            except ProtocolError as exc:
                problems.setdefault(job_id, str(exc))
                versions.append(0)
    endings = JobLifecycle(store).endings(ids)
    rows = []
    for (job_id, last_active), version in zip(listed, versions, strict=True):
        record = records.get(job_id)
        if job_id in problems:
            # Keys someone else overwrote (on Redis 6.2 ranks may): named, not hidden.
            rows.append(_unreadable(job_id, problems[job_id], now - last_active))
            continue
        if record is None:
            continue  # Deleted while we looked.
        ending = endings[job_id]
        if ending.finished:
            state = "finished"
        elif record.error:
            state = "failed"
        else:
            state = "running" if version else "starting"
        created = float(record.fields.get("created_at") or last_active)
        rows.append(
            {
                "job_id": job_id,
                "state": state,
                "world_size": record.info.world_size,
                "version": version,
                "age_s": round(now - created, 1),
                "idle_s": round(now - last_active, 1),
                "ranks_finished": ending.ranks_finished,
                "finished_at": ending.finished_at,
                "error": record.error,
            }
        )
    return rows


def _unreadable(job_id: str, problem: str, idle_s: float) -> dict[str, Any]:
    """A row of :func:`job_rows` for a job whose keys cannot be read; ``error`` says why."""
    return {
        "job_id": job_id,
        "state": "unreadable",
        "world_size": 0,
        "version": 0,
        "age_s": 0.0,
        "idle_s": round(idle_s, 1),
        "ranks_finished": 0,
        "finished_at": None,
        "error": problem,
    }


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


@click.group("jobs")
def jobs_group() -> None:
    """Jobs in Redis: list them, delete one, or mark one finished.

    A job is finished when every rank's hook closed (or `perseus jobs finish`); the
    coordinator deletes finished jobs after finished_retention (PERSEUS_FINISHED_RETENTION).
    """


@jobs_group.command("list")
@redis_url_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def jobs_list(redis_url: str | None, as_json: bool) -> None:
    """Show every job: id, state, world size, version, age, idle time, ranks finished."""
    rows = job_rows(JobStore(connect_settings(redis_url)))
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    if not rows:
        click.echo("no jobs")
        return
    width = max(len("JOB ID"), *(len(row["job_id"]) for row in rows))  # ids with metadata grow
    click.echo(
        f"{'JOB ID':<{width}} {'STATE':<9} {'WORLD':>5} {'VER':>4} {'AGE':>7} {'IDLE':>7} FINISHED"
    )
    for row in rows:
        click.echo(
            f"{row['job_id']:<{width}} {row['state']:<9} {row['world_size']:>5} "
            f"{row['version']:>4} {_duration(row['age_s']):>7} {_duration(row['idle_s']):>7} "
            f"{row['ranks_finished']}/{row['world_size']}"
            + (f"  {row['error']}" if row["state"] == "unreadable" else "")
        )


@jobs_group.command("delete")
@redis_url_option
@click.argument("job_ids", nargs=-1, required=True)
def jobs_delete(redis_url: str | None, job_ids: tuple[str, ...]) -> None:
    """Delete JOB_IDS: every key of each, atomically, and their index entries.

    Ranks still training keep their current schedule; their heartbeats say the job is gone.
    """
    store = JobStore(connect_settings(redis_url))
    missing = []
    for job_id in dict.fromkeys(job_ids):  # once each: a repeat was deleted, then "unknown"
        if not store.conn.exists(keys.job_info(job_id)):
            missing.append(job_id)
            continue
        store.delete_job(job_id)
        click.echo(f"deleted job {job_id}")
    if missing:
        raise _unknown(missing)


@jobs_group.command("finish")
@redis_url_option
@click.argument("job_ids", nargs=-1, required=True)
def jobs_finish(redis_url: str | None, job_ids: tuple[str, ...]) -> None:
    """Mark JOB_IDS finished, whatever their ranks did (deleted after finished_retention)."""
    lifecycle = JobLifecycle(JobStore(connect_settings(redis_url)))
    job_ids = tuple(dict.fromkeys(job_ids))  # once each, as delete takes them
    missing = [job_id for job_id in job_ids if not lifecycle.finish_job(job_id)]
    for job_id in job_ids:
        if job_id not in missing:
            click.echo(f"job {job_id} is finished")
    if missing:
        raise _unknown(missing)


def _unknown(job_ids: list[str]) -> click.ClickException:
    """The error for job ids Redis does not have, worded as ``dump`` and ``target`` word it."""
    return click.ClickException("; ".join(str(unknown_job(job_id)) for job_id in job_ids))
