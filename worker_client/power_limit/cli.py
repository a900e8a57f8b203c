"""``perseus power-limit``: inspect, import, export and delete power-limit profiles in Redis.

Profile files are Zeus's format (:mod:`worker_client.power_limit.profile`), so a profile can
go from a Zeus run to Redis (``import``) and back (``export``).

The group is registered on the ``perseus`` command by the root command group
(:mod:`coordinator.cli`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from protocol.cli_options import note_default_url, redis_url_option
from protocol.connection import DEFAULT_REDIS_URL
from protocol.exceptions import ConfigError, CoordinatorUnavailableError, ProtocolError
from worker_client.power_limit.profile import (
    format_profile,
    format_table,
    format_time,
    load_profile_file,
    save_profile_file,
)
from worker_client.power_limit.store import PowerLimitProfileStore

_redis_url_option = redis_url_option(default_help=f"Default: {DEFAULT_REDIS_URL}.")


@contextmanager
def _opened_store(redis_url: str | None) -> Iterator[PowerLimitProfileStore]:
    """The profile store at ``redis_url``, closed after the block.

    Raises:
        click.ClickException: Redis is out of reach, a name or setting is wrong, or a stored
            profile is unreadable (the message only, not a traceback).
    """
    if redis_url is None:
        note_default_url()
    store = PowerLimitProfileStore.from_url(redis_url or DEFAULT_REDIS_URL)
    try:
        yield store
    except (CoordinatorUnavailableError, ConfigError, ProtocolError) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        store.client.close()


@click.group("power-limit")
def power_limit_group() -> None:
    """Power-limit profiles shared across runs of a workload."""


@power_limit_group.command("show")
@click.argument("workload", required=False)
@_redis_url_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--file",
    "path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Show this profile file (Zeus's or perseus-mq's) instead of Redis.",
)
def show(workload: str | None, redis_url: str | None, as_json: bool, path: Path | None) -> None:
    """List stored workloads, or show WORKLOAD's measurements (* marks the chosen limit)."""
    if path is not None and workload is not None:
        raise click.UsageError("give a WORKLOAD or --file, not both")
    if path is not None:
        try:
            from_file = load_profile_file(path)
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(
            from_file.model_dump_json(indent=2) if as_json else format_profile(str(path), from_file)
        )
        return
    with _opened_store(redis_url) as store:
        if workload is None:
            summaries = store.list_profiles()
            if as_json:
                click.echo(json.dumps([dataclasses.asdict(s) for s in summaries], indent=2))
                return
            if not summaries:
                click.echo("no power-limit profiles stored")
                return
            rows = [
                [
                    s.workload,
                    # As `show WORKLOAD` says "no limit chosen"; a "?" read as an unknown value.
                    "none chosen" if s.optimal_power_limit is None else str(s.optimal_power_limit),
                    str(s.num_measurements),
                    format_time(s.updated_at),
                ]
                for s in summaries
            ]
            click.echo(format_table(["workload", "limit (W)", "measurements", "updated"], rows))
            return
        profile = store.load(workload)
        if profile is None:
            raise click.ClickException(f"no power-limit profile stored for {workload!r}")
        if as_json:
            click.echo(profile.model_dump_json(indent=2))
            return
        click.echo(format_profile(workload, profile))


@power_limit_group.command("delete")
@click.argument("workload")
@_redis_url_option
def delete(workload: str, redis_url: str | None) -> None:
    """Delete WORKLOAD's stored profile (the next run profiles again)."""
    with _opened_store(redis_url) as store:
        if not store.delete(workload):
            raise click.ClickException(f"no power-limit profile stored for {workload!r}")
    click.echo(f"deleted the power-limit profile of {workload!r}")


@power_limit_group.command("import")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("workload")
@_redis_url_option
def import_profile(path: Path, workload: str, redis_url: str | None) -> None:
    """Store the profile file PATH (e.g. written by Zeus) as WORKLOAD's profile."""
    with _opened_store(redis_url) as store:
        profile = load_profile_file(path)
        store.save(workload, profile)
    click.echo(f"stored {len(profile.measurements)} measurements from {path} as {workload!r}")


@power_limit_group.command("export")
@click.argument("workload")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@_redis_url_option
def export_profile(workload: str, path: Path, redis_url: str | None) -> None:
    """Write WORKLOAD's stored profile to PATH, a profile file Zeus can read."""
    with _opened_store(redis_url) as store:
        profile = store.load(workload)
    if profile is None:
        raise click.ClickException(f"no power-limit profile stored for {workload!r}")
    if not path.parent.is_dir():  # as cp: a mistyped folder is no folder to make
        raise click.ClickException(f"cannot write {path}: no folder {path.parent}")
    try:
        save_profile_file(profile, path, make_folders=False)
    except OSError as exc:  # e.g. no permission, /proc
        raise click.ClickException(f"cannot write {path}: {exc.strerror or exc}") from None
    click.echo(f"wrote the power-limit profile of {workload!r} to {path}")
