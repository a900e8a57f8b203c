"""Redis URLs that redis-py reads silently wrong are refused, naming the part that is wrong."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from coordinator.cli import main
from protocol.connection import connect
from protocol.exceptions import ConfigError, CoordinatorUnavailableError
from protocol.models import JobInfo
from tests.helpers import free_ports, invoke_perseus
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


def test_a_redis_url_with_a_bad_database_or_query_parameter_is_one_line(redis_url):
    # redis-py took /abc as database 0 (a shared server's data, silently), and passed a
    # misspelt query parameter to the connection: a TypeError traceback at the first command.
    code, out = invoke_perseus("status", "--redis-url", "redis://127.0.0.1:1/abc")
    assert code == 1 and "the database 'abc' in the URL's path is not a number" in out
    sep = "&" if "?" in redis_url else "?"
    for command in (("status",), ("deadletter", "list"), ("jobs", "list")):
        code, out = invoke_perseus(*command, "--redis-url", f"{redis_url}{sep}ssl_ca_cert=/ca.pem")
        assert code == 1, out
        assert "unknown query parameter(s) ssl_ca_cert" in out and "Traceback" not in out
    code, out = invoke_perseus("status", "--redis-url", f"{redis_url}{sep}db=0&socket_timeout=5")
    assert code == 0, out


@pytest.mark.parametrize("password", ["se/cret", "se?cret", "se#cret", "se@cr/et"])
def test_a_password_a_url_cannot_hold_is_named_as_the_problem_and_never_printed(password):
    # docker-compose.yml puts PERSEUS_REDIS_PASSWORD into the services' URLs: one made with
    # `openssl rand -base64` holds "/", and every restart of the coordinator and the workers
    # printed the URL with the password in clear (or redis-py's "Port could not be cast to
    # integer value as 'se'") into `docker compose logs` and the healthcheck's log.
    from coordinator.health import check

    url = f"redis://:{password}@redis:6379/0"
    for command in (("status",), ("jobs", "list"), ("coordinator",), ("worker",)):
        code, out = invoke_perseus(*command, env={"PERSEUS_REDIS_URL": url})
        assert code != 0, out
        assert "cret" not in out and "'se'" not in out and "Traceback" not in out, out
        assert "redis://:***@" in out, out
        if "/" in password:
            assert "its password holds '/'" in out and "%2F" in out, out
    ok, message = check(url, "host", 30)
    assert not ok and "cret" not in message and "'se'" not in message, message


def test_a_query_parameter_redis_py_parses_but_the_connection_does_not_take_is_refused(redis_url):
    # redis-py parses ?timeout= (its BlockingConnectionPool's) and ?ssl_check_hostname= (a TLS
    # connection's) in any URL and hands them to the connection: on a plain one, the TypeError
    # traceback at the first command that the check of query parameters is there to prevent.
    sep = "&" if "?" in redis_url else "?"
    for name, value in (("timeout", "5"), ("ssl_check_hostname", "false")):
        with pytest.raises(ConfigError, match=rf"unknown query parameter\(s\) {name} "):
            connect(f"{redis_url}{sep}{name}={value}", ping=True)
    code, out = invoke_perseus("status", "--redis-url", f"{redis_url}{sep}ssl_ca_certs=/ca.pem")
    assert code == 1 and "TLS settings need a rediss:// URL" in out, out
    # Database digits are ASCII ones (redis-py read an Arabic-Indic one as database 1).
    with pytest.raises(ConfigError, match="in the URL's path is not a number"):
        connect("redis://127.0.0.1:1/\u0661")
    # What redis-py's connection takes still passes, TLS settings with rediss:// too.
    taken = "db=0&socket_timeout=5&health_check_interval=10&protocol=3&max_connections=8"
    connect(f"{redis_url}{sep}{taken}&client_name=t", ping=True).close()
    connect("rediss://127.0.0.1:1/0?ssl_cert_reqs=none&ssl_check_hostname=false").close()


def test_a_query_parameter_without_a_value_is_refused_by_name() -> None:
    # redis-py's parse_qs drops ?name and ?name= unsaid: a misspelt ?ssl_ca_cert passed.
    for query in ("?foo", "?foo=", "?socket_timeout=5&foo"):
        with pytest.raises(ConfigError, match=r"unknown query parameter\(s\) foo for a redis://"):
            connect(f"redis://127.0.0.1:1/0{query}")
    # A setting the connection takes, but with no value, would do nothing as well.
    with pytest.raises(ConfigError, match=r"query parameter\(s\) socket_timeout without a value"):
        connect("redis://127.0.0.1:1/0?socket_timeout=")
    connect("redis://127.0.0.1:1/0?socket_timeout=5").close()


def test_a_database_path_takes_one_trailing_slash_and_nothing_else() -> None:
    # redis-py reads /0/ as database 0 (it drops every slash): accepted as it is.
    for path, db in (("/0/", 0), ("/3/", 3), ("/3", 3), ("/", 0), ("", 0)):
        client = connect(f"redis://127.0.0.1:1{path}")
        assert client.connection_pool.connection_kwargs.get("db", 0) == db, path
        client.close()
    # redis-py reads /1/2 as database 12: refused, naming the path, the password hidden.
    for path in ("/1/2", "/1/2/", "/0//", "//"):
        with pytest.raises(ConfigError, match=f"the URL's path '{path}' is not /DB") as caught:
            connect(f"redis://user:s3cret@127.0.0.1:1{path}")
        assert "s3cret" not in str(caught.value) and "user:***@" in str(caught.value)
    with pytest.raises(ConfigError, match="the database 'abc' in the URL's path is not a number"):
        connect("redis://127.0.0.1:1/abc/")


def test_no_redis_at_the_url_says_what_to_start(tmp_path):
    # A first `perseus status` where no Redis runs: what is wrong, and what to do about it.
    (port,) = free_ports()
    for url in (f"redis://127.0.0.1:{port}/0", f"unix://{tmp_path}/redis.sock"):
        code, out = invoke_perseus("status", "--redis-url", url)
        assert code == 1, out
        assert f"cannot reach Redis at {url}" in out
        assert "no Redis listens there" in out and "`perseus redis`" in out, out
        assert "--redis-url or PERSEUS_REDIS_URL" in out
