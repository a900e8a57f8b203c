"""``perseus deadletter``: list, show, replay and purge what the coordinator could not process."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from typing import Any

import click

from coordinator.cli_common import connect_settings
from protocol.cli_options import redis_url_option
from protocol.cli_types import FiniteFloatRange
from protocol.codec import unpack_raw
from protocol.constants import MAX_ENTRY_FIELDS
from protocol.deadletter import (
    DeadLetter,
    get_dead_letter,
    iter_dead_letters,
    list_dead_letters,
    purge,
    replay,
)
from protocol.exceptions import PerseusError, ProtocolError


@click.group("deadletter")
def deadletter_group() -> None:
    """Entries the coordinator could not process, with the reason (perseus:stream:deadletter)."""


@deadletter_group.command("list")
@redis_url_option
@click.option(
    "--count",
    default=100,
    show_default=True,
    type=click.IntRange(min=1),
    help="How many dead letters to show, oldest first.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of lines.")
def deadletter_list(redis_url: str | None, count: int, as_json: bool) -> None:
    """Show the oldest COUNT dead letters: id, time, source stream, kind, job and reason."""
    letters = list_dead_letters(connect_settings(redis_url), count)
    if as_json:
        click.echo(json.dumps([d.summary() for d in letters], indent=1))
        return
    if not letters:
        click.echo("no dead letters")
    for d in letters:
        click.echo(_heading(d))


def _heading(d: DeadLetter) -> str:
    """A dead letter's line (id, time, source, kind, job) and its reason's, as ``list`` shows."""
    when = (
        datetime.fromtimestamp(d.dead_at, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        if d.dead_at
        else "?"  # not recorded, or no time (an entry added by hand)
    )
    mark = "" if d.replayable else "  (not replayable)"
    source = f"{d.source_stream or '?'} {d.source_id or '?'}"
    return (
        f"{d.entry_id}  {when}  {source}  {d.kind or '?'}  {d.job_id or '-'}{mark}\n    {d.reason}"
    )


@deadletter_group.command("show")
@redis_url_option
@click.argument("entry_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of lines.")
def deadletter_show(redis_url: str | None, entry_id: str, as_json: bool) -> None:
    """Show one dead letter whole: its reason and every field the client sent.

    ``data`` is decoded from msgpack (shown as JSON); other values as text, or as hex where
    they are not UTF-8. An entry of more than 64 fields, kept packed in one, is shown field
    by field too.
    """
    try:
        letter = get_dead_letter(connect_settings(redis_url), entry_id)
    except PerseusError as exc:
        raise click.ClickException(str(exc)) from None
    fields = {
        name.decode(errors="replace"): _readable(name, value)
        for name, value in letter.original.items()
    }
    if as_json:
        click.echo(json.dumps(letter.summary() | {"size": letter.size, "fields": fields}, indent=1))
        return
    click.echo(_heading(letter))
    if letter.size is not None:
        click.echo(f"  an entry of {letter.size} bytes: only the head of its fields was kept")
    click.echo(f"  fields ({len(fields)}):")
    for name, value in fields.items():
        click.echo(f"    {name}: {_as_text(name, value)}")


def _as_text(name: str, value: Any) -> str:
    """A field as ``show`` prints it: decoded ``data`` as JSON, bytes as ``(hex) ...``."""
    if isinstance(value, dict) and "hex" in value and (name != "data" or "error" in value):
        error = f", {value['error']}" if "error" in value else ""
        return f"(hex{error}) {value['hex']}"
    return json.dumps(value) if name == "data" else str(value)


def _readable(name: bytes, value: bytes) -> Any:
    """A field's value for people: ``data`` unpacked, text as text, other bytes as hex."""
    if name == b"data":
        try:
            return _json_safe(unpack_raw(value))
        except ProtocolError as exc:
            return {"hex": value.hex(), "error": str(exc)}
    try:
        return value.decode()
    except UnicodeDecodeError:
        return {"hex": value.hex()}


def _json_safe(value: Any) -> Any:
    """``value`` (unpacked msgpack) with bytes as ``{"hex": ...}`` and every key as text."""
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no NaN or infinity
    return value


@deadletter_group.command("replay")
@redis_url_option
@click.argument("entry_ids", nargs=-1)
@click.option("--all", "replay_all", is_flag=True, help="Every replayable dead letter.")
def deadletter_replay(redis_url: str | None, entry_ids: tuple[str, ...], replay_all: bool) -> None:
    """Send dead letters back to the stream they came from (results and control only).

    An entry that fails again is dead-lettered again with the new reason: nothing is lost.
    """
    if bool(entry_ids) == replay_all:
        both = " or --all, not both" if replay_all else ", or --all"
        raise click.UsageError(f"give dead-letter ids{both}")
    conn = connect_settings(redis_url)
    replayed = 0
    skipped: Counter[str] = Counter()  # why --all left dead letters alone

    def replayable(letters: Iterable[DeadLetter]) -> Iterator[DeadLetter]:
        for letter in letters:
            if letter.replayable:
                yield letter
            else:
                skipped[_why_not_replayable(letter)] += 1

    try:
        if replay_all:
            # Read a page at a time, up to the newest there was at the start: one that fails
            # again is dead-lettered anew, after that point, and not replayed twice here.
            letters: Iterable[DeadLetter] = replayable(iter_dead_letters(conn))
        else:
            letters = [get_dead_letter(conn, entry_id) for entry_id in entry_ids]
        for letter in letters:
            new_id = replay(conn, letter)
            replayed += 1
            if new_id is None:
                click.echo(f"{letter.entry_id}: gone meanwhile (replayed by someone else?)")
            else:
                click.echo(f"{letter.entry_id} -> {letter.source_stream} {new_id}")
    except PerseusError as exc:
        raise click.ClickException(str(exc)) from None
    if replay_all and not replayed:
        click.echo("no replayable dead letters")
    for why, count in sorted(skipped.items()):
        click.echo(
            f"left alone: {count} dead letter(s) {why} (`perseus deadletter list` shows them)"
        )


def _why_not_replayable(letter: DeadLetter) -> str:
    """Why ``replay --all`` leaves ``letter`` alone, as :func:`replay` would refuse it."""
    if letter.size is not None:
        return "over max_entry_bytes (only their heads were kept)"
    if letter.too_many_fields:
        return f"with more than {MAX_ENTRY_FIELDS} fields (they would be refused again)"
    if not letter.original:
        return "without original fields"
    return (
        f"from {letter.source_stream or 'no stream'} (only results and control messages can "
        "be replayed: a registration's client got the error and no longer waits)"
    )


@deadletter_group.command("purge")
@redis_url_option
@click.argument("entry_ids", nargs=-1)
@click.option(
    "--older-than",
    type=FiniteFloatRange(min=0),
    default=None,
    help="Delete dead letters older than this many seconds.",
)
@click.option("--all", "purge_all", is_flag=True, help="Delete every dead letter.")
def deadletter_purge(
    redis_url: str | None, entry_ids: tuple[str, ...], older_than: float | None, purge_all: bool
) -> None:
    """Delete dead letters for good: ENTRY_IDS, those older than --older-than, or --all."""
    given = sum((bool(entry_ids), older_than is not None, purge_all))
    if given == 0:
        raise click.UsageError("give dead-letter ids, --older-than SECONDS, or --all")
    if given > 1:
        raise click.UsageError("give one of dead-letter ids, --older-than SECONDS and --all")
    conn = connect_settings(redis_url)
    try:
        for entry_id in entry_ids:
            get_dead_letter(conn, entry_id)  # a wrong id fails as replay's does, before any
        removed = purge(conn, list(entry_ids) if entry_ids else None, older_than)
    except PerseusError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"deleted {removed} dead letter(s)")
