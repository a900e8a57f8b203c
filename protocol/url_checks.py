"""Redis URLs checked for what redis-py would ignore unsaid, or fail on later with a traceback."""

from __future__ import annotations

import inspect
from urllib.parse import SplitResult, parse_qs, urlsplit

from protocol.numbers import is_ascii_digits


def check_url(url: str, connection_class: type) -> None:
    """Refuse what redis-py would silently ignore in ``url``, or fail on with a traceback later.

    redis-py takes a database path that is not a number (``redis://host:6379/abc``) as
    database 0, drops every slash from it (``/1/2`` is database 12), and passes every query
    parameter to the connection, so a misspelt one (``?ssl_ca_cert=``) raised a ``TypeError``
    at the first command, while one without a value (``?ssl_ca_cert``) was dropped unsaid.
    The path is empty, ``/``, or ``/N`` with one optional trailing slash (``/0/``).

    Nor does it say when a parameter is given twice (the first wins), when ``?db=`` and the
    path disagree (``?db=`` wins), when a ``#fragment`` follows (dropped), or when ``?db=-1``
    or a ``unix://`` URL without a path (or with a host instead) name no Redis: those
    failed as "cannot reach Redis", or not at all.

    Raises:
        ValueError: The message names the part of the URL that is wrong.
    """
    if "#" in url:
        # redis-py drops a fragment unsaid: whatever follows '#' (a setting, the rest of a
        # ?password=) did nothing. Not quoted: it may be part of a password.
        raise ValueError(
            "it has a '#' fragment, which redis-py ignores: remove it (a '#' in a password is "
            "written %23)"
        )
    parts = urlsplit(url)
    path_db = _check_path(parts)
    query = parse_qs(parts.query, keep_blank_values=True)
    _check_query_names(parts.scheme, query, connection_class)
    blank = sorted(name for name, values in query.items() if not any(values))
    if blank:
        raise ValueError(
            f"query parameter(s) {', '.join(blank)} without a value (redis-py would ignore "
            "them): give one, as in ?socket_timeout=5, or leave the parameter out"
        )
    # Values not quoted: one may be a password.
    twice = sorted(name for name, values in query.items() if len(values) > 1)
    if twice:
        raise ValueError(
            f"query parameter(s) {', '.join(twice)} given more than once (redis-py uses the "
            "first and ignores the rest): give each once"
        )
    if "db" in query:
        db = query["db"][0]
        if not is_ascii_digits(db):  # redis-py's int() takes -1 (SELECT's error later), " 1"
            raise ValueError(f"?db={db!r} is not a database number (0, 1, 2 ...)")
        if path_db is not None and int(path_db) != int(db):  # redis-py takes ?db= unsaid
            raise ValueError(
                f"the path names database {path_db} but ?db= names {db} (redis-py would use "
                f"{db}): give the database once"
            )


def _check_path(parts: SplitResult) -> str | None:
    """Check the URL's path (a ``unix://`` socket's, else ``/DB``); return the DB it names."""
    if parts.scheme == "unix":
        if parts.path in ("", "/") and not parse_qs(parts.query).get("path"):
            # redis-py connected to "" ("Error 22 ... Invalid argument": not a Redis fault).
            raise ValueError(
                "a unix:// URL needs the socket's path, as in unix:///run/redis/redis.sock"
            )
        if parts.hostname not in (None, "localhost"):
            # redis-py ignores the host: unix://tmp/redis.sock connected to /redis.sock.
            raise ValueError(
                f"it names host {parts.hostname!r}, which a unix:// URL does not take (redis-py "
                f"would use {parts.path!r}): the socket's path follows three slashes, as in "
                f"unix:///{parts.hostname}{parts.path}"
            )
        return None
    if parts.scheme not in ("redis", "rediss") or parts.path in ("", "/"):
        return None
    segments = parts.path[1:].removesuffix("/").split("/")
    if len(segments) > 1 or not segments[0]:
        raise ValueError(
            f"the URL's path {parts.path!r} is not /DB (one database number, as in "
            "redis://host:6379/0)"
        )
    if not is_ascii_digits(segments[0]):
        raise ValueError(
            f"the database {segments[0]!r} in the URL's path is not a number "
            "(redis://host:6379/0 selects database 0)"
        )
    return segments[0]


def _check_query_names(scheme: str, query: dict[str, list[str]], connection_class: type) -> None:
    """Refuse a query parameter that redis-py's connection does not take."""
    # What the connection pool hands on: its own size, and what the connection class takes.
    # Not every name redis-py parses: ``timeout`` is its BlockingConnectionPool's, ``ssl_*``
    # a TLS connection's, ``socket_keepalive`` a TCP one's; elsewhere each is the TypeError.
    accepted = {"max_connections"}
    for cls in connection_class.__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            for param in inspect.signature(init).parameters.values():
                if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                    accepted.add(param.name)
    accepted.discard("self")
    # keep_blank_values (the caller's): redis-py drops ``?name`` and ``?name=`` unsaid.
    unknown = sorted(set(query) - accepted)
    if unknown:
        hint = "a redis-py connection setting such as db, socket_timeout or ssl_ca_certs"
        if scheme != "rediss" and any(name.startswith("ssl_") for name in unknown):
            hint = "TLS settings need a rediss:// URL"
        raise ValueError(
            f"unknown query parameter(s) {', '.join(unknown)} for a {scheme}:// URL ({hint})"
        )
