"""`perseus dump`, `profile` and `target`: a job's data out of Redis, and a new target in."""

from __future__ import annotations

from pathlib import Path

import click
import redis

from coordinator.cli_common import connect_settings, load_settings, out_option, write_out
from coordinator.dump import COMPLETE, dump_job
from protocol.cli_options import connect_or_fail, lost_redis_message, redis_url_option
from protocol.constants import MAX_TARGET_ITERATION_S, MIN_TARGET_ITERATION_S
from protocol.exceptions import ConfigError, PerseusError
from protocol.job_lifecycle import JobLifecycle
from protocol.scheduler import BUILTIN, resolve_scheduler
from protocol.store import JobStore
from schedulers.instruction_profiler import PROFILE_ARTIFACT
from worker_client.hook.session import CoordinatorClient


@click.command("dump")
@redis_url_option
@click.argument("job_id")
@click.option("--out", "out_dir", default="./dump", show_default=True, help="Folder to write to.")
def dump_command(redis_url: str | None, job_id: str, out_dir: str) -> None:
    """Write a job's ranks, schedules, results and journal to OUT/JOB_ID/ as JSON."""
    settings = load_settings(redis_url=redis_url)
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise click.BadParameter(f"{out_dir} exists and is not a folder", param_hint="--out")
    store = JobStore(connect_or_fail(settings.redis_url))
    folder = Path(out_dir) / job_id
    try:
        dump = dump_job(store, job_id, out_dir)
    except PerseusError as exc:
        raise click.ClickException(str(exc)) from None
    except (redis.TimeoutError, redis.ConnectionError) as exc:
        # Mid-dump: what was written looked like a whole dump, and the error did not say.
        raise click.ClickException(f"{_incomplete(folder)}{lost_redis_message(exc)}") from None
    except OSError as exc:
        raise click.ClickException(
            f"{_incomplete(folder)}cannot write the dump under {out_dir}: {exc}"
        ) from None
    click.echo(f"wrote {dump.folder}{dump.note()}")


def _incomplete(folder: Path) -> str:
    """``the dump in FOLDER is incomplete ...: `` where a failed dump left part of one."""
    if not folder.is_dir() or (folder / COMPLETE).exists():
        return ""  # nothing written yet (an earlier dump's files are whole)
    return f"the dump in {folder} is incomplete (it has no {COMPLETE!r} file; run it again): "


@click.command("profile")
@redis_url_option
@click.argument("job_id")
@out_option("profile.csv", "File to write; - for standard output.")
def profile_command(redis_url: str | None, job_id: str, out_path: str) -> None:
    """Fetch the instruction profile that JOB_ID's InstructionProfiler measured.

    The CSV is what `perseus optimize` reads: profile a job, then optimize, choose and train
    with the chosen plan (Zeus's workflow).
    """
    store = JobStore(connect_settings(redis_url))
    try:
        record = store.get_job(job_id)
    except PerseusError as exc:
        raise click.ClickException(str(exc)) from None
    data = store.artifacts(job_id).get(PROFILE_ARTIFACT)
    if data is None:
        state = f"error: {record.error}" if record.error else f"at version {store.version(job_id)}"
        raise click.ClickException(
            f"job {job_id} has no profile yet ({record.config.scheduler}, {state}); a job that "
            "registers with scheduler='InstructionProfiler' gets one when its sweep ends"
        )
    if not write_out(out_path, data):
        return
    click.echo(f"wrote {out_path} ({len(data.splitlines()) - 1} rows); next: perseus optimize")


# Negative numbers are arguments here, so that `perseus target JOB -1` says what is wrong
# with -1 instead of "No such option: -1".
@click.command("target", context_settings={"ignore_unknown_options": True})
@redis_url_option
@click.argument("job_id")
@click.argument("seconds", type=float)
def target_command(redis_url: str | None, job_id: str, seconds: float) -> None:
    """Ask JOB_ID's scheduler to aim at an iteration time of SECONDS (e.g. a straggler's).

    Goes through the control stream like every other input; schedulers that serve a frontier
    switch every rank to the least-energy plan that meets the target in a new version. Fails
    for an unknown or finished job, or a scheduler that takes no target.
    """
    settings = load_settings(redis_url=redis_url)
    if not MIN_TARGET_ITERATION_S <= seconds <= MAX_TARGET_ITERATION_S:  # also NaN, inf
        raise click.BadParameter(
            f"must be a positive number of seconds from {MIN_TARGET_ITERATION_S:g} to "
            f"{MAX_TARGET_ITERATION_S:g} (a day), got {seconds}",
            param_hint="SECONDS",
        )
    store = JobStore(connect_or_fail(settings.redis_url))
    try:
        record = store.get_job(job_id)
        scheduler_cls = resolve_scheduler(record.config.scheduler)
    except PerseusError as exc:
        raise click.ClickException(str(exc)) from None
    # A finished job's ranks run nothing more: its scheduler would publish versions for nobody.
    if JobLifecycle(store).endings([job_id])[job_id].finished:
        raise click.ClickException(
            f"job {job_id} is finished (its ranks' hooks closed, or `perseus jobs finish`): "
            "no rank would run a new target"
        )
    if not scheduler_cls.takes_target():
        takers = [n for n in sorted(BUILTIN) if _takes_target(n)]
        raise click.ClickException(
            f"job {job_id} runs {record.config.scheduler}, which takes no target iteration "
            f"time (schedulers that do: {', '.join(takers)})"
        )
    # Its command timeout, not a registering client's (reply_timeout + 30 s).
    client = CoordinatorClient(settings.redis_url, conn=store.conn)
    try:
        client.set_target(job_id, seconds)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="SECONDS") from None
    click.echo(f"asked job {job_id} for an iteration time of {seconds} s")


def _takes_target(name: str) -> bool:
    try:
        return resolve_scheduler(name).takes_target()
    except ConfigError:
        return False
