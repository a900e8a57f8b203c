"""Coordinator heartbeats and the container healthcheck (coordinator/health.py), real Redis."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from coordinator.health import beat, check, forget_stale, host_idle_s, last_beats
from protocol import keys
from tests.helpers import ROOT, subprocess_env, wait_for


def test_no_coordinator_yet_is_unhealthy(r, redis_url):
    assert host_idle_s(r, socket.gethostname(), time.time()) is None
    ok, message = check(redis_url, socket.gethostname(), 30)
    assert not ok and "no coordinator of host" in message


def test_running_coordinator_is_healthy_and_a_stopped_one_is_not(r, redis_url, service):
    host = socket.gethostname()
    wait_for(lambda: host_idle_s(r, host, time.time()) is not None, what="a heartbeat")
    assert service.consumer in last_beats(r)
    # It beats about once a second while its loop runs, also when no entry arrives.
    time.sleep(2.5)
    # A beat came after the first one (a loaded machine may delay a round: poll for it).
    wait_for(lambda: host_idle_s(r, host, time.time()) < 1.5, 5, "a beat 2.5 s on")
    ok, message = check(redis_url, host, 5)
    assert ok, message
    # Another host's coordinator does not count for this one.
    assert host_idle_s(r, host + "-elsewhere", time.time()) is None
    # One that stopped cleanly took its heartbeat with it; a killed one leaves an old one.
    service.stop_event.set()
    wait_for(lambda: service.consumer not in last_beats(r), what="the heartbeat removed")
    ok, message = check(redis_url, host, 1.2)
    assert not ok and "no coordinator of host" in message
    beat(r, service.consumer, time.time() - 3)
    ok, message = check(redis_url, host, 1.2)
    assert not ok and "last ran a round" in message


def test_stale_heartbeats_are_forgotten(r):
    now = time.time()
    beat(r, "gone-1", now - 7200)
    beat(r, "alive-7", now - 5)
    assert forget_stale(r, now, older_than=3600) == ["gone-1"]
    assert set(last_beats(r)) == {"alive-7"}
    assert r.type(keys.COORDINATORS) == b"hash"


def test_unreachable_redis_is_unhealthy_and_the_password_is_not_shown():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ok, message = check(f"redis://:s3cret-pw@127.0.0.1:{port}/0", "h", 30)
    assert not ok and "unhealthy: redis" in message
    assert "s3cret-pw" not in message


def test_module_exit_status(redis_url, service, tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "coordinator.health", *args],
            env=subprocess_env(tmp_path, PERSEUS_REDIS_URL=redis_url),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    healthy = wait_for(lambda: (p := run()).returncode == 0 and p, timeout=20, what="healthy")
    assert healthy.stdout.startswith("healthy")
    service.stop_event.set()
    time.sleep(1.5)
    stale = run("--max-idle", "1")
    assert stale.returncode == 1 and stale.stdout.startswith("unhealthy"), stale.stdout
