"""A registration's reply survives Redis shutting down as the rank reads it."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import redis

from coordinator.embedded import EmbeddedRedis
from coordinator.service import Coordinator
from protocol import keys
from protocol.models import JobInfo, RankInfo
from tests.helpers import make_settings, register, running, wait_for
from worker_client.hook.session import CoordinatorClient, _Retry


def _reading(thread: threading.Thread) -> bool:
    """Whether ``thread`` sent its command and waits for the answer (redis-py's read)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "read_response":
            return True
        frame = frame.f_back
    return False


def _down(url: str) -> bool:
    try:
        redis.Redis.from_url(url).ping()
    except redis.ConnectionError:
        return True
    return False


def test_a_reply_read_as_redis_shuts_down_is_read_again_after_the_restart():
    """Redis runs the rank's read, then shuts down before writing the answer back.

    Redis drops the answers of the commands it ran in its last moment (a SHUTDOWN, or a
    restart's SIGTERM, handled after the commands read with it). A BLPOP had taken the reply
    for good (the append-only file kept the pop): the rank then waited its whole
    ``reply_timeout`` for a reply that was gone, and its training failed with "no coordinator
    answered register_rank", under load, in ``test_a_rank_starting_rides_through_redis_restarts``.
    """
    with EmbeddedRedis(appendonly=True) as server:
        conn = redis.Redis.from_url(server.url)
        key = keys.reply_key("read-at-shutdown")
        conn.lpush(key, b"the reply")  # the coordinator answered before the rank read
        conn.expire(key, 300)
        client = CoordinatorClient(server.url, reply_timeout=10)
        client.conn.ping()  # connected: Redis will answer nothing until it runs again
        shutdown = redis.Redis.from_url(server.url, single_connection_client=True)
        shutdown.ping()
        got: dict[str, Any] = {}

        def read() -> None:
            deadline = time.monotonic() + client.reply_timeout
            got["reply"] = client._read_reply(key, deadline, _Retry(client, "read", deadline))

        # Frozen, Redis reads the rank's command and the SHUTDOWN together once resumed, in
        # the order they came: it runs the read, then shuts down before answering it.
        os.kill(server.pid, signal.SIGSTOP)
        try:
            thread = threading.Thread(target=read, daemon=True)
            thread.start()
            wait_for(lambda: _reading(thread), 10, "the rank's read sent")
            shutdown.connection.send_command("SHUTDOWN")
        finally:
            os.kill(server.pid, signal.SIGCONT)
        wait_for(lambda: _down(server.url), 10, "redis shut down")
        server.restart()
        thread.join(timeout=30)
        assert got["reply"] == b"the reply"
        client.close()


def _replies(conn: redis.Redis) -> list[bytes]:
    return list(conn.scan_iter(match=keys.reply_key("*")))


def test_the_replies_read_are_removed_by_release_idle_and_at_close():
    """Read without being taken, each reply (a rank's carries its token) is removed all the
    same, off the registration's path: by ``release_idle()`` (the hook's, once its first
    schedule came) or ``close()``."""
    with EmbeddedRedis() as server:
        conn = redis.Redis.from_url(server.url)
        client = CoordinatorClient(server.url, reply_timeout=10)
        coord = Coordinator(redis.Redis.from_url(server.url), make_settings(server.url))
        with running(coord):
            register(client, pp=2)  # a job, then its two ranks
            assert len(_replies(conn)) == 3
            client.release_idle()
            assert _replies(conn) == []
            register(client, pp=1)
            assert len(_replies(conn)) == 2
            client.close()
        assert _replies(conn) == []


def test_a_registration_says_redis_is_back_when_it_answers_not_when_the_reply_comes(caplog):
    # Logged once the reply came (or at the deadline): a coordinator that answered late, or
    # not at all, made it read "redis ... is back after 30.0 s" though Redis had long been.
    with EmbeddedRedis(appendonly=True) as server:
        client = CoordinatorClient(server.url, reply_timeout=60)
        got: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: got.update(job=register(client, pp=1)), daemon=True
        )
        with caplog.at_level(logging.WARNING, logger="worker_client.hook.session"):
            thread.start()
            conn = redis.Redis.from_url(server.url)
            wait_for(lambda: conn.xlen(keys.REGISTRATIONS_STREAM) == 1, 10, "the request")
            server.restart(downtime=0.5)
            # No coordinator runs yet: the client must say Redis is back all the same.
            wait_for(lambda: "is back after" in caplog.text, 20, "the client's 'is back'")
            coord = Coordinator(redis.Redis.from_url(server.url), make_settings(server.url))
            with running(coord):
                thread.join(timeout=30)
        assert "job" in got and caplog.text.count("is back after") == 1, caplog.text
        client.close()


def test_registrations_keep_one_connection_and_release_idle_gives_it_back(monkeypatch):
    """A registration's two commands skip redis-py's pool checkout (5-8% of one client's
    registration rate); ``release_idle()`` still leaves that connection closed."""
    with EmbeddedRedis() as server:
        client = CoordinatorClient(server.url, reply_timeout=10)
        coord = Coordinator(redis.Redis.from_url(server.url), make_settings(server.url))
        pool = client.conn.connection_pool
        checkouts = [0]
        original = type(pool).get_connection

        def counted(self: redis.ConnectionPool, *args: object, **kwargs: object) -> object:
            if self is pool:
                checkouts[0] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(type(pool), "get_connection", counted)
        job = JobInfo(pp_degree=4, dp_degree=1, tp_degree=1, world_size=4)
        with running(coord):
            job_id = client.register_job(job)  # the first registration takes the connection
            taken = checkouts[0]
            for rank in range(4):  # four ranks: eight commands, no checkout
                client.register_rank(
                    job_id,
                    RankInfo(
                        rank=rank,
                        dp_rank=0,
                        pp_rank=rank,
                        tp_rank=0,
                        available_frequencies=[1980, 1965],
                    ),
                )
            assert checkouts[0] == taken
            kept = client._registrations().connection
            assert kept is not None and kept.is_connected
            client.release_idle()
            assert not kept.is_connected
            register(client, pp=1)  # connects again
        client.close()


def test_threads_registering_at_once_share_one_kept_connection(monkeypatch):
    """Two threads' first registrations on one client made two kept connections: one was
    lost, checked out of the pool, and stayed open past ``release_idle()``."""

    class SlowRedis(redis.Redis):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if kwargs.get("single_connection_client"):
                time.sleep(0.05)  # widens the gap between "none yet" and "made"
            super().__init__(*args, **kwargs)

    with EmbeddedRedis() as server:
        client = CoordinatorClient(server.url, reply_timeout=10)
        monkeypatch.setattr(redis, "Redis", SlowRedis)
        made: list[redis.Redis] = []
        threads = [
            threading.Thread(target=lambda: made.append(client._registrations())) for _ in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert len(made) == 4 and all(kept is made[0] for kept in made), made
        client.close()
