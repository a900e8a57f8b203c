"""What the ``perseus`` commands share: settings built from the environment, checked connections."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import redis
from pydantic import ValidationError
from pydantic_settings import SettingsError

from coordinator.settings import PerseusSettings, unknown_variables, zeus_variables
from protocol.acl import role_user
from protocol.cli_options import connect_or_fail, lost_redis_message, note_default_url
from protocol.exceptions import PerseusError


class PerseusGroup(click.Group):
    """The ``perseus`` group: a Redis ACL refusal is one line saying which user a command needs."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; a ``NOPERM``, or Redis hanging or gone mid-command, is one line."""
        try:
            return super().invoke(ctx)
        except (redis.TimeoutError, redis.ConnectionError) as exc:
            # After the command's PING: was a traceback after the whole socket timeout.
            raise click.ClickException(lost_redis_message(exc)) from None
        except redis.ResponseError as exc:
            # NOPERM, or its form inside a script ("The user executing the script can't run").
            if not isinstance(exc, redis.exceptions.NoPermissionError) and not any(
                mark in str(exc) for mark in ("NOPERM", "no permissions", "can't run this")
            ):
                raise
            raise click.ClickException(
                f"Redis refused this command to the connected user (NOPERM: {exc}). Reading "
                f"commands (status, dump, profile, deadletter list, power-limit show) need "
                f"{role_user('operator')} or {role_user('service')}; commands that change "
                f"state need {role_user('service')}. Connected as the right user already? "
                "Its rules may be out of date: write the ACL file again with `perseus acl` "
                '(README "Who may do what").'
            ) from None


def check_variables() -> None:
    """Refuse ``PERSEUS_*`` variables that nothing reads (a typo would go unnoticed).

    Raises:
        click.UsageError: Naming each, with the closest known name.
    """
    unknown = unknown_variables(os.environ)
    if unknown:
        raise click.UsageError("; ".join(unknown))


def load_settings(**overrides: Any) -> PerseusSettings:
    """Settings from ``PERSEUS_*`` variables, with the flags given (not ``None``) on top.

    Built here, in the entry point, never at import.

    Raises:
        click.UsageError: An unknown ``PERSEUS_*`` variable (a typo, say) or an invalid value;
            the message names it.
    """
    check_variables()
    for note in zeus_variables(os.environ):
        click.echo(f"note: {note}", err=True)
    given = {k: v for k, v in overrides.items() if v is not None}
    # Settings are read whatever the case of their variables (see unknown_variables).
    if "redis_url" not in given and "PERSEUS_REDIS_URL" not in {k.upper() for k in os.environ}:
        note_default_url()
    try:
        return PerseusSettings(**given)
    except ValidationError as exc:
        raise click.UsageError(_settings_errors(exc, given)) from None
    except SettingsError as exc:
        # A variable pydantic-settings could not even parse (JSON of a dict field, say).
        field = re.search(r'field "(\w+)"', str(exc))
        name = f"PERSEUS_{field.group(1).upper()}" if field else "a PERSEUS_* variable"
        raise click.UsageError(f"{name} is not valid: {exc.__cause__ or exc}") from None
    except RecursionError:  # JSON nested thousands deep; scheduler_args is the JSON setting
        raise click.UsageError("PERSEUS_SCHEDULER_ARGS is not valid: nested too deeply") from None
    except PerseusError as exc:
        raise click.UsageError(str(exc)) from None


def _settings_errors(exc: ValidationError, flags: dict[str, Any]) -> str:
    """One line per invalid setting, naming the flag's or variable's name and the value."""
    lines = ["invalid settings:"]
    for err in exc.errors():
        if not err["loc"]:  # a check of several settings together
            lines.append(f"  {err['msg']}")
            continue
        field = str(err["loc"][0])
        where = f"PERSEUS_{field.upper()}"
        if field in flags:  # given as a flag, or read from the variable by click
            where += f" / --{field.replace('_', '-')}"
        shown = repr(err.get("input"))
        shown = shown if len(shown) <= 80 else f"{shown[:60]}... ({len(shown)} characters)"
        message = err["msg"].removeprefix("Value error, ")  # pydantic's word for a ValueError
        lines.append(f"  {where} = {shown}: {message}")
    return "\n".join(lines)


def connect_settings(redis_url: str | None) -> redis.Redis:
    """A client on ``--redis-url`` or ``PERSEUS_REDIS_URL``, checked like every setting.

    Each reply is waited for :data:`protocol.cli_options.COMMAND_TIMEOUT_S` at most.
    """
    return connect_or_fail(load_settings(redis_url=redis_url).redis_url)


def out_option(default: str, help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--out`` (``out_path``): the file to write, ``-`` for standard output (:func:`write_out`).

    Args:
        default: The file when ``--out`` is not given.
        help_text: The option's help (it should say what ``-`` means).
    """
    return click.option("--out", "out_path", default=default, show_default=True, help=help_text)


def write_out(out_path: str, data: str | bytes, private: bool = False) -> bool:
    """Write ``data`` to the ``--out`` file, or to standard output where it is ``-``.

    Args:
        out_path: The ``--out`` value.
        data: What to write (bytes go to standard output decoded as UTF-8).
        private: Readable by its owner only (0600): it holds secrets or their hashes.

    Returns:
        Whether a file was written (the caller then says so).

    Raises:
        click.ClickException: The file could not be written (its name and the reason).
    """
    if out_path == "-":
        click.echo(data if isinstance(data, str) else data.decode(), nl=False)
        return False
    raw = data.encode() if isinstance(data, str) else data
    try:
        if private:
            # Created 0600, and an existing file narrowed before the secrets go in: a chmod
            # after the write left them readable by others in between (or for good, failed).
            fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as file:
                os.fchmod(fd, 0o600)
                file.write(raw)
        else:
            Path(out_path).write_bytes(raw)
    except OSError as exc:
        # The reason alone: str(exc) names the path again ("[Errno 21] Is a directory: 'X'").
        raise click.ClickException(f"cannot write {out_path}: {exc.strerror or exc}") from None
    return True


@contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """Inside the block, SIGTERM and SIGHUP raise ``KeyboardInterrupt``, as Ctrl-C does.

    For commands whose children run in sessions of their own (``perseus redis``'s server,
    the demo's Redis and rq worker), which no signal to the terminal reaches: Python's default
    for either signal ended the command at once and left them running. SIGHUP comes when the
    terminal closes (a closed tab, a dropped ssh). A SIGHUP inherited as ignored (``nohup``)
    stays ignored. The handlers found are restored on the way out (a caller's own, when the
    command runs in-process).
    """
    caught: list[int] = []

    def interrupt(signum: int, frame: Any) -> None:
        caught.append(signum)
        raise KeyboardInterrupt

    found: dict[signal.Signals, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if sig is signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
            continue
        found[sig] = signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in found.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    if caught:
        # The block ended as if nothing came: the signal's KeyboardInterrupt was raised where
        # Python drops exceptions (a __del__, a weakref callback run by the garbage collector),
        # and a SIGTERM during clean-up ended the process with status 0.
        raise KeyboardInterrupt
