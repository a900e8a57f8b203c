"""Redis clients built one way, with explicit timeouts, and Redis URLs safe to print.

Besides redis-py's ``redis://``, ``rediss://`` (TLS) and ``unix://`` URLs, every component takes
``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]`` (``rediss+sentinel``
with TLS): the client asks the sentinels for the current master of ``service`` and finds the new
one after a failover. The password, if any, is the data nodes' password; sentinels are asked
without one unless ``sentinel_password`` is given as a query parameter. ``socket_timeout``, as
in a ``redis://`` URL, sets the seconds a command waits for the master's reply.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.sentinel import MasterNotFoundError, Sentinel

from protocol.exceptions import ConfigError, CoordinatorUnavailableError
from protocol.numbers import is_ascii_digits
from protocol.url_checks import check_url

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
CONNECT_TIMEOUT_S = 5.0
SOCKET_TIMEOUT_S = 30.0
"""Default socket timeout; a blocking command must block for less (see :func:`connect`)."""


def _tls_hint(url: str, exc: Exception) -> str:
    """A hint where a TLS mismatch looks like another fault, or where nothing listens at all."""
    text = str(exc).lower()
    if "connection refused" in text or "no such file or directory" in text:
        # A first `perseus status` on a machine with no Redis on the default URL lands here.
        return (
            " (no Redis listens there: start one, or run `perseus redis` for a private one, "
            "and give its URL with --redis-url or PERSEUS_REDIS_URL)"
        )
    if url.startswith("rediss://") and "timeout" in text:
        return " (does this port speak TLS? rediss:// needs a TLS port; redis:// is plain text)"
    if url.startswith("redis://") and ("reset by peer" in text or "closed by server" in text):
        return " (a TLS port? use rediss:// for TLS)"
    return ""


class _TLSConnection(redis.SSLConnection):
    """redis-py's TLS connection, its handshake bounded by the connect timeout.

    redis-py runs the handshake under the socket timeout (30 s here): a ``rediss://`` URL that
    names a plain-text Redis waits that long, as Redis keeps reading the client's hello as
    the start of a command and never answers.
    """

    def _wrap_socket_with_ssl(self, sock: Any) -> Any:
        sock.settimeout(self.socket_connect_timeout)
        wrapped = super()._wrap_socket_with_ssl(sock)
        wrapped.settimeout(self.socket_timeout)
        return wrapped


def connect(
    url: str,
    *,
    socket_timeout: float | None = SOCKET_TIMEOUT_S,
    connect_timeout: float = CONNECT_TIMEOUT_S,
    ping: bool = False,
    check_timeout: float | None = None,
    dedicated: bool = False,
) -> redis.Redis:
    """A Redis client with explicit connect and socket timeouts.

    A client that runs blocking reads (``BLPOP``, ``XREAD BLOCK``) must pass a
    ``socket_timeout`` longer than its longest block, or the read fails with a timeout
    although Redis is fine.

    Args:
        url: ``redis://``, ``rediss://`` or ``unix://`` URL.
        socket_timeout: Seconds a command may take (``None``: no limit).
        connect_timeout: Seconds to connect.
        ping: Check the server answers now.
        check_timeout: Seconds that check waits for its answer, on a client of its own that
            is closed then (default: ``socket_timeout``; a URL's ``?socket_timeout=`` wins). A
            service's start against a hanging Redis then fails within seconds, not its
            blocking reads' longer ``socket_timeout``.
        dedicated: A client that keeps one connection for itself (and connects now), for a
            loop on one thread such as the coordinator's: each command skips redis-py's
            pool checkout, about 10 us with redis-py 8 (a poll of the socket and two
            metric calls), which a registration's round trip pays twice. Pipelines
            still take connections from the pool; other threads wait on a lock. Ignored
            for a sentinel URL: redis-py finds a new master only for connections its pool
            hands out, so a kept one would retry the lost master for ever.

    Raises:
        CoordinatorUnavailableError: ``ping`` and the server does not answer; the message
            names the URL with its password hidden.
        ConfigError: ``url`` is not a Redis URL, or (``ping``) names a database the server
            does not have (see :func:`no_such_database`).

    """
    if ping and check_timeout is not None and check_timeout != socket_timeout:
        connect(
            url, socket_timeout=check_timeout, connect_timeout=connect_timeout, ping=True
        ).close()
        ping = False
    conn: redis.Redis | None = None
    try:
        if url.startswith(SENTINEL_SCHEMES):
            parsed = parse_sentinel_url(url)
            if parsed.socket_timeout is not None:  # the URL's wins, as redis-py's from_url does
                socket_timeout = parsed.socket_timeout
            conn = _sentinel_master(parsed, socket_timeout, connect_timeout)
        else:
            conn = redis.Redis.from_url(
                url,
                socket_timeout=socket_timeout,
                socket_connect_timeout=connect_timeout,
                health_check_interval=30,
            )
            check_url(url, conn.connection_pool.connection_class)
            if conn.connection_pool.connection_class is redis.SSLConnection:
                conn.connection_pool.connection_class = _TLSConnection  # nothing connected yet
        if ping:
            conn.ping()
        if dedicated and not url.startswith(SENTINEL_SCHEMES):
            kept = redis.Redis(connection_pool=conn.connection_pool, single_connection_client=True)
            # The client dropped here would close the pool (kept's connection too) when
            # collected: the pool is kept's to close now.
            kept.auto_close_connection_pool = conn.auto_close_connection_pool
            conn.auto_close_connection_pool = False
            conn = kept
    except MasterNotFoundError:
        # redis-py's message ends with the repr of every sentinel client (kilobytes).
        hosts = ", ".join(f"{h}:{p}" for h, p in parse_sentinel_url(url).hosts)
        raise CoordinatorUnavailableError(
            f"cannot reach Redis at {redact_url(url)}: no sentinel at {hosts} answered with "
            f"a master for {parse_sentinel_url(url).service!r}"
        ) from None
    except redis.AuthenticationError as exc:
        # Redis answered: the user name or password is what is wrong, not the address.
        raise CoordinatorUnavailableError(
            f"Redis at {redact_url(url)} refused the login: {exc} (check the user name and "
            "password in the URL)"
        ) from None
    except redis.TimeoutError as exc:
        # A server that hangs (stopped, or a network that drops packets), not one that is down.
        waited = connect_timeout if "connect" in str(exc) else socket_timeout_of(conn)
        raise CoordinatorUnavailableError(
            f"{did_not_answer(url, waited)} ({exc}){_tls_hint(url, exc)}"
        ) from None
    except redis.RedisError as exc:
        # Redis answered, refusing the SELECT of the URL's database sent on connecting.
        if isinstance(exc, redis.ResponseError) and (why := no_such_database(url, conn, exc)):
            raise ConfigError(why) from None
        raise CoordinatorUnavailableError(
            f"cannot reach Redis at {redact_url(url)}: {exc}{_tls_hint(url, exc)}"
        ) from None
    except ValueError as exc:
        why = str(exc)
        if "scheme" in why:  # redis-py's list leaves out the sentinel schemes
            why = "it must start with redis://, rediss://, unix://, "
            why += " or ".join(SENTINEL_SCHEMES)
            if url.lower().startswith(("http://", "https://")):
                # Zeus's PerseusOptimizer took its HTTP server's URL in redis_url's place.
                why += (
                    "; this is an HTTP server's URL, as Zeus's server_url was: ranks and "
                    "services meet in Redis, so give the Redis URL that `perseus coordinator` "
                    "uses"
                )
        elif reserved := _reserved_in_password(url):
            # redis-py's own message quotes the piece of the password before the character
            # (as a port: "Port could not be cast to integer value as 'abc'").
            why = (
                f"its password holds {' and '.join(map(repr, reserved))}, which a URL reads "
                "as the end of the host part: percent-encode it (/ is %2F, ? is %3F, # is "
                "%23), or choose a password of letters and digits"
            )
        raise ConfigError(f"invalid Redis URL {redact_url(url)!r}: {why}") from None
    return conn


# Redis's answers to SELECT past its databases, and past a 32-bit number.
_DB_OUT_OF_RANGE = ("DB index is out of range", "value is out of range")


def no_such_database(url: str, conn: redis.Redis | None, exc: Exception) -> str | None:
    """``database N does not exist on URL: the server has M (0 to M-1)``, for SELECT's error.

    Redis says only "DB index is out of range", which read as "cannot reach Redis". The count
    is found with SELECT on a connection of its own (a user that may select the URL's
    database may select the others; CONFIG needs rights an ACL user may lack); where that
    fails, the message says Redis's default instead.

    Args:
        url: The URL ``conn`` was made from (its password is not shown).
        conn: The client whose connection was refused.
        exc: The error Redis answered with.

    Returns:
        The message, or None where ``exc`` is not that error.
    """
    if conn is None or not any(text in str(exc) for text in _DB_OUT_OF_RANGE):
        return None
    db = int(conn.connection_pool.connection_kwargs.get("db") or 0)
    if not db:  # database 0 always exists: the error is another command's
        return None
    count = _database_count(conn, db)
    has = (
        f"the server has {count} (0 to {count - 1})"
        if count
        else "the server has fewer (its `databases` setting; 16 unless set: 0 to 15)"
    )
    return f"database {db} does not exist on {redact_url(url)}: {has}; use one of those"


def _database_count(conn: redis.Redis, db: int) -> int | None:
    """How many databases the server has, below ``db``, by binary search with SELECT."""
    pool = conn.connection_pool
    if type(pool) is not redis.ConnectionPool:  # a Sentinel's pool makes its own connections
        return None
    link = pool.connection_class(**{**pool.connection_kwargs, "db": 0})
    low, high = 1, db  # database 0 exists; ``db`` does not
    try:
        link.connect()
        while low < high:  # the count lies in [low, high]
            middle = (low + high + 1) // 2
            link.send_command("SELECT", middle - 1)
            try:
                link.read_response()
            except redis.ResponseError:
                high = middle - 1
            else:
                low = middle
    except (redis.RedisError, OSError):
        return None
    finally:
        link.disconnect()
    return low


def socket_timeout_of(conn: redis.Redis | None) -> float | None:
    """The seconds ``conn`` waits for a reply (``None``: no limit, or no client).

    A URL's ``?socket_timeout=`` wins over :func:`connect`'s argument.
    """
    if conn is None:
        return None
    value = conn.connection_pool.connection_kwargs.get("socket_timeout")
    return None if value is None else float(value)


def longest_block(conn: redis.Redis | None, wanted: float) -> float:
    """Seconds a blocking read on ``conn`` may wait: ``wanted``, cut below its socket time-out.

    A URL's ``?socket_timeout=`` wins over the time-out a caller chose for its blocking
    reads: a read blocking as long would fail with a time-out on a healthy Redis. Leaves a
    second (or half of a shorter time-out) for the reply to travel.
    """
    timeout = socket_timeout_of(conn)
    if timeout is None:
        return wanted
    return min(wanted, max(timeout - 1.0, timeout / 2))


def did_not_answer(url: str, seconds: float | None) -> str:
    """``Redis at URL did not answer within N s``, the password hidden."""
    within = f" within {seconds:g} s" if seconds is not None else ""
    return f"Redis at {redact_url(url)} did not answer{within}"


# scheme://[user][:password]@rest -> the password part; also hides ?password=... parameters.
# The password runs to the last "@": one holding "/", "?", "#" or "@" (which the URL parsers
# do not take there) is still hidden whole, and a URL with "@" further on loses more, not less.
_USERINFO = re.compile(r"^(?P<head>[a-z+]+://)(?P<user>[^:@/]*)(?::(?P<pw>.*))?@", re.DOTALL)
_PW_PARAM = re.compile(r"((?:^|[?&])(?:sentinel_)?password=)[^&]*")


def _reserved_in_password(url: str) -> list[str]:
    """The characters of ``url``'s password that end a URL's host part ("/", "?", "#")."""
    match = _USERINFO.match(url)
    password = (match.group("pw") if match else None) or ""
    return [c for c in "/?#" if c in password]


def redact_url(url: str) -> str:
    """``url`` with every password replaced by ``***`` (user, hosts, ports and db kept)."""
    match = _USERINFO.match(url)
    if match and match.group("pw") is not None:
        url = f"{match.group('head')}{match.group('user')}:***@{url[match.end() :]}"
    return _PW_PARAM.sub(r"\1***", url)


SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``redis+sentinel://`` URL."""

    hosts: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False
    socket_timeout: float | None = None


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse ``redis+sentinel://[user:pw@]h1:p1[,h2:p2...]/service[/db][?query]``.

    The query takes ``sentinel_password`` and ``socket_timeout`` (seconds, above 0).

    Raises:
        ValueError: The URL names no host, no service, a bad port or a bad db, has another
            query parameter (or one twice), a ``socket_timeout`` that is not a number of
            seconds, or a ``#`` fragment.

    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("redis+sentinel", "rediss+sentinel"):
        raise ValueError(f"not a sentinel URL: {redact_url(url)}")
    if "#" in url:  # dropped by urlsplit unsaid (not quoted: it may hold a password)
        raise ValueError("sentinel URL has a '#' fragment: remove it (a '#' in a password is %23)")
    parts = urlsplit(f"x://{rest}")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, _, pw = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(pw) or None
    hosts = []
    for item in filter(None, hostlist.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not is_ascii_digits(port) or not 0 < int(port) < 65536:
            raise ValueError(f"sentinel URL host {item!r} is not host:port (port 1-65535)")
        hosts.append((host, int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not hosts or not path:
        raise ValueError(f"sentinel URL needs host:port and /service: {redact_url(url)}")
    if len(path) > 2 or (len(path) == 2 and not is_ascii_digits(path[1])):
        raise ValueError(f"sentinel URL path must be /service[/db]: {redact_url(url)}")
    query = parse_qs(parts.query, keep_blank_values=True)
    unused = sorted(set(query) - {"sentinel_password", "socket_timeout"})
    if unused:  # read by nothing: a setting that would do nothing, unsaid (or a misspelling)
        raise ValueError(
            f"sentinel URL parameter(s) {', '.join(unused)} not supported: a sentinel URL "
            "takes only ?sentinel_password= and ?socket_timeout="
        )
    for name in ("sentinel_password", "socket_timeout"):
        if len(query.get(name, ())) > 1:
            raise ValueError(f"sentinel URL gives {name} more than once: give it once")
    socket_timeout = None
    if "socket_timeout" in query:
        given = query["socket_timeout"][-1]
        try:
            socket_timeout = float(given)
        except ValueError:
            socket_timeout = math.nan
        if not 0 < socket_timeout < math.inf:
            raise ValueError(
                f"sentinel URL parameter socket_timeout={given!r} is not a number of seconds "
                "above 0 (as in ?socket_timeout=10)"
            )
    return SentinelURL(
        hosts=tuple(hosts),
        service=path[0],
        db=int(path[1]) if len(path) == 2 else 0,
        username=username,
        password=password,
        sentinel_password=query.get("sentinel_password", [None])[0],
        ssl=scheme == "rediss+sentinel",
        socket_timeout=socket_timeout,
    )


def _sentinel_master(
    parsed: SentinelURL, socket_timeout: float | None, connect_timeout: float
) -> redis.Redis:
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": connect_timeout,
        "socket_connect_timeout": connect_timeout,
    }
    if parsed.sentinel_password:
        sentinel_kwargs["password"] = parsed.sentinel_password
    sentinel = Sentinel(list(parsed.hosts), sentinel_kwargs=sentinel_kwargs)
    # A master_for client rediscovers the master when a command fails on a lost or demoted
    # one (redis-py turns READONLY from a demoted master into a ConnectionError).
    return sentinel.master_for(
        parsed.service,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        db=parsed.db,
        username=parsed.username,
        password=parsed.password,
        ssl=parsed.ssl,
    )
