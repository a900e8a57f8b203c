"""The ``--redis-url`` option and Redis connection shared by every ``perseus`` command."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click
import redis

from protocol.connection import DEFAULT_REDIS_URL, connect, redact_url
from protocol.exceptions import PerseusError

F = TypeVar("F", bound=Callable[..., Any])


REDIS_URL_HELP = (
    "Redis URL, e.g. redis://localhost:6379/0, rediss://host:6380/0 or unix:///path/redis.sock."
)


def redis_url_option(func: F | None = None, *, default_help: str | None = None) -> Any:
    """``--redis-url`` (env ``PERSEUS_REDIS_URL``); ``None`` when neither is given.

    Args:
        func: The command (when used as a plain decorator).
        default_help: What happens without a URL (default: :data:`DEFAULT_REDIS_URL`).

    """
    option = click.option(
        "--redis-url",
        envvar="PERSEUS_REDIS_URL",
        default=None,
        show_envvar=True,
        help=f"{REDIS_URL_HELP} {default_help or f'Default: {DEFAULT_REDIS_URL}.'}",
    )
    return option(func) if func is not None else option


def setting_option(
    *decls: str, setting: str, help: str, default_text: str | None = None, **kwargs: Any
) -> Callable[[F], F]:
    """An option for a ``PerseusSettings`` field, also read from ``PERSEUS_<SETTING>``.

    Every settings option shows its variable the same way (click's ``[env var: ...]``) and,
    when given, its default; ``None`` reaches the command when neither flag nor variable is set.

    Args:
        decls: The option's names, e.g. ``"--scheduler"``.
        setting: The settings field it sets.
        help: What it does.
        default_text: The default to show (the settings' default applies).
        kwargs: More ``click.option`` arguments.
    """
    shown = f" Default: {default_text}." if default_text else ""
    return click.option(
        *decls,
        envvar=f"PERSEUS_{setting.upper()}",
        show_envvar=True,
        default=None,
        help=f"{help}{shown}",
        **kwargs,
    )


#: Variables other tools read a Redis URL from (redis-py users, rq's CLI); perseus does not.
FOREIGN_URL_VARIABLES = ("REDIS_URL", "RQ_REDIS_URL")


def note_default_url(environ: Mapping[str, str] = os.environ) -> None:
    """On stderr: the default URL is used although another tool's URL variable is set.

    Call it where no ``--redis-url`` or ``PERSEUS_REDIS_URL`` was given. Without it such a
    command read the default Redis unsaid (``perseus status`` said "jobs: 0").
    """
    found = [name for name in FOREIGN_URL_VARIABLES if environ.get(name)]
    if found:
        click.echo(
            f"note: {found[0]} is set, but perseus reads only --redis-url or PERSEUS_REDIS_URL: "
            f"using {DEFAULT_REDIS_URL}",
            err=True,
        )


def connect_or_fail(
    url: str | None, socket_timeout: float | None = 30.0, dedicated: bool = False
) -> redis.Redis:
    """A client on ``url`` (default :data:`DEFAULT_REDIS_URL`) that answered a PING.

    Args:
        url: The Redis URL.
        socket_timeout: Seconds a command may take.
        dedicated: One connection kept by the client (see :func:`protocol.connection.connect`).

    Raises:
        click.ClickException: Redis does not answer, or the URL is not one (an empty one
            included); the password is not shown.

    """
    try:
        return connect(
            DEFAULT_REDIS_URL if url is None else url,
            socket_timeout=socket_timeout,
            ping=True,
            dedicated=dedicated,
        )
    except PerseusError as exc:
        raise click.ClickException(str(exc)) from None


__all__ = [
    "FOREIGN_URL_VARIABLES",
    "connect_or_fail",
    "note_default_url",
    "redact_url",
    "redis_url_option",
    "setting_option",
]
