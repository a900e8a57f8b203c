"""Redis URLs that redis-py reads silently wrong are refused, naming the part that is wrong."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from coordinator.cli import main
from protocol.connection import connect
from protocol.exceptions import ConfigError, CoordinatorUnavailableError
from protocol.models import JobInfo
from worker_client.hook.session import CoordinatorClient


def status(url: str) -> tuple[int, str]:
    """``perseus status --redis-url URL``: the exit code and everything printed."""
    result = CliRunner().invoke(main, ["status", "--redis-url", url], catch_exceptions=False)
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("url", "words"),
    [
        # redis-py used the first ?db= (database 1) and dropped the second unsaid.
        ("redis://127.0.0.1:1/?db=1&db=2", r"query parameter\(s\) db given more than once"),
        ("redis://127.0.0.1:1/0?socket_timeout=5&socket_timeout=9", "socket_timeout given more"),
        # A fragment was dropped: here the end of a password given as ?password=.
        ("redis://127.0.0.1:1/0#x", "it has a '#' fragment, which redis-py ignores"),
        ("redis://127.0.0.1:1/0?password=ab#cd", "it has a '#' fragment"),
        ("redis+sentinel://127.0.0.1:1/mymaster#x", "sentinel URL has a '#' fragment"),
        (
            "redis+sentinel://127.0.0.1:1/m?sentinel_password=a&sentinel_password=b",
            "gives sentinel_password more than once",
        ),
        # redis-py connected to /redis.sock: the host part is not the socket's first folder.
        ("unix://tmp/redis.sock", "it names host 'tmp'.*as in unix:///tmp/redis.sock"),
    ],
)
def test_what_redis_py_would_drop_or_misread_is_refused(url: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as caught:
        connect(url)
    assert "cd" not in str(caught.value)  # the end of the ?password= is not shown


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("unix://", "a unix:// URL needs the socket's path, as in unix:///"),
        ("unix:///", "a unix:// URL needs the socket's path"),
        ("redis://127.0.0.1:1/?db=-1", "\\?db='-1' is not a database number"),
    ],
)
def test_a_url_that_names_no_redis_is_a_bad_url_not_an_unreachable_redis(
    url: str, words: str
) -> None:
    # These reached redis-py, which failed to connect: "cannot reach Redis at unix://:
    # Error 22 connecting to . Invalid argument", as if the server were down.
    code, out = status(url)
    assert code == 1, out
    assert f"invalid Redis URL '{url}'" in out and "cannot reach" not in out, out
    with pytest.raises(ConfigError, match=words):
        connect(url)


def test_a_database_given_twice_must_agree_and_a_unix_socket_may_name_localhost(
    redis_url,
) -> None:
    # redis-py took ?db= over the path's database unsaid.
    with pytest.raises(ConfigError, match="the path names database 3 but \\?db= names 4"):
        connect("redis://127.0.0.1:1/3?db=4")
    sep = "&" if "?" in redis_url else "?"
    code, out = status(f"{redis_url}{sep}db=0")
    assert code == 0, out
    for url in ("redis://127.0.0.1:1/0?db=0", "redis://127.0.0.1:1/2/?db=02"):
        connect(url).close()
    client = connect("unix://localhost/tmp/redis.sock")
    assert client.connection_pool.connection_kwargs["path"] == "/tmp/redis.sock"
    client.close()


@pytest.mark.parametrize("url", ["http://localhost:7787", "https://perseus.example.org/"])
def test_an_http_url_is_told_to_be_the_coordinators_redis(url: str) -> None:
    # Zeus's PerseusOptimizer took its HTTP server's URL in redis_url's place (server_url);
    # the refusal listed Redis's schemes only, as if the scheme were a typo.
    with pytest.raises(ConfigError, match="it must start with redis://") as caught:
        connect(url)
    assert "an HTTP server's URL, as Zeus's server_url was" in str(caught.value)
    assert "the Redis URL that `perseus coordinator` uses" in str(caught.value)


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["jobs", "list"],
        ["deadletter", "list"],
        ["coordinator", "--scheduler", ""],
        ["worker", "--burst", "--no-preload"],
    ],
)
def test_a_database_the_server_lacks_is_named_with_how_many_it_has(r, redis_url, command):
    # Said as "cannot reach Redis at URL: DB index is out of range", though Redis answered.
    count = int(r.config_get("databases")["databases"])
    sep = "&" if "?" in redis_url else "?"
    for db in (count, 10**12):  # the second is past SELECT's 32-bit range
        url = f"{redis_url}{sep}db={db}"
        result = CliRunner().invoke(main, [*command, "--redis-url", url])
        assert result.exit_code == 1, result.output
        assert result.output == (
            f"Error: database {db} does not exist on {url}: the server has {count} "
            f"(0 to {count - 1}); use one of those\n"
        )
    # A training hook's registration says so too.
    client = CoordinatorClient(f"{redis_url}{sep}db={count}", reply_timeout=5)
    job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    with pytest.raises(CoordinatorUnavailableError, match=f"database {count} does not exist"):
        client.register_job(job, "PointSolution")
