"""The ``--redis-url`` option and Redis connection shared by every ``perseus`` command."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click
import redis

from protocol.connection import (
    DEFAULT_REDIS_URL,
    connect,
    did_not_answer,
    redact_url,
    socket_timeout_of,
)
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


COMMAND_TIMEOUT_S = 5.0
"""Seconds an operator's command (``perseus status``, ``jobs``, ``dump``...) waits for each
reply: a Redis that hangs gets a one-line error, not a wait of the services' 30 s."""

_CONNECTED = "perseus.redis"  # click's meta (shared by nested commands): (URL, timeout)


def connect_or_fail(
    url: str | None, socket_timeout: float | None = COMMAND_TIMEOUT_S, dedicated: bool = False
) -> redis.Redis:
    """A client on ``url`` (default :data:`DEFAULT_REDIS_URL`) that answered a PING.

    The PING waits :data:`COMMAND_TIMEOUT_S` for its answer whatever ``socket_timeout``: a
    service (coordinator, worker) started against a hanging Redis says so within seconds.

    A Redis that stops answering or goes away later, in the command, is one line too (see
    :func:`lost_redis_message`).

    Args:
        url: The Redis URL (its ``?socket_timeout=`` wins over ``socket_timeout``).
        socket_timeout: Seconds a command may wait for its reply.
        dedicated: One connection kept by the client (see :func:`protocol.connection.connect`).

    Raises:
        click.ClickException: Redis does not answer, or the URL is not one (an empty one
            included); the password is not shown.

    """
    url = DEFAULT_REDIS_URL if url is None else url
    try:
        conn = connect(
            url,
            socket_timeout=socket_timeout,
            ping=True,
            check_timeout=COMMAND_TIMEOUT_S,
            dedicated=dedicated,
        )
    except PerseusError as exc:
        # A service's longer timeout (its blocking reads) is not for the user to shorten.
        hint = _wait_longer_hint(url, str(exc)) if socket_timeout == COMMAND_TIMEOUT_S else ""
        raise click.ClickException(f"{exc}{hint}") from None
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta[_CONNECTED] = (url, socket_timeout_of(conn))
    return conn


def _wait_longer_hint(url: str, message: str) -> str:
    if "did not answer" not in message:
        return ""
    if "socket_timeout=" in url.partition("?")[2]:  # told to add what the URL has
        return "; to wait longer, raise the URL's ?socket_timeout="
    return "; to wait longer, add ?socket_timeout=SECONDS to the URL"


def lost_redis_message(exc: redis.TimeoutError | redis.ConnectionError) -> str:
    """One line for a Redis that stopped answering (or went away) in a command.

    Names the URL (password hidden) and the time waited, as the connection's own error does.
    """
    ctx = click.get_current_context(silent=True)
    url, waited = ctx.meta.get(_CONNECTED, (None, None)) if ctx is not None else (None, None)
    if url is None:
        return f"Redis failed: {exc}"
    if isinstance(exc, redis.TimeoutError):
        line = f"{did_not_answer(url, waited)} ({exc})"
        return line + _wait_longer_hint(url, line)
    return f"lost the connection to Redis at {redact_url(url)}: {exc}"


__all__ = [
    "COMMAND_TIMEOUT_S",
    "FOREIGN_URL_VARIABLES",
    "connect_or_fail",
    "lost_redis_message",
    "note_default_url",
    "redact_url",
    "redis_url_option",
    "setting_option",
]
