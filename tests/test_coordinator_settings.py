"""Coordinators that share a Redis must agree on the settings that decide what jobs get."""

from __future__ import annotations

import threading
import time

import pytest

from coordinator.health import agree_settings, beat
from coordinator.service import Coordinator
from protocol import keys
from protocol.connection import connect
from protocol.exceptions import ConfigError
from tests.helpers import make_settings, running, wait_for

PLAN = "[[('forward', 1980), ('backward', 1980)]]"  # a plan text that parses


def test_a_second_coordinator_with_another_scheduler_refuses_to_start(r, redis_url):
    first = make_settings(redis_url, "tests.toy_schedulers:StepDown")
    agree_settings(r, "host-a-1", first.shared(), time.time())
    beat(r, "host-a-1", time.time())

    other = make_settings(redis_url, "PointSolution", scheduler_args={"plan_text": PLAN})
    with pytest.raises(ConfigError) as caught:
        Coordinator(r, other).run(block_ms=10)
    message = str(caught.value)
    assert "coordinator host-a-1 (running" in message
    assert "scheduler: 'tests.toy_schedulers:StepDown' there, 'PointSolution' here" in message
    assert f"scheduler_args: {{}} there, {{'plan_text': {PLAN!r}}} here" in message
    assert "stall_timeout" not in message  # only what differs is named


def test_same_settings_or_a_stopped_coordinator_do_not_block_a_start(r, redis_url):
    settings = make_settings(redis_url)
    agree_settings(r, "host-a-1", settings.shared(), time.time())
    beat(r, "host-a-1", time.time())
    agree_settings(r, "host-b-1", settings.shared(), time.time())  # same settings: fine

    # A coordinator that stopped long ago (no heartbeat for a minute) does not count.
    beat(r, "host-a-1", time.time() - 60)
    other = make_settings(redis_url, "PointSolution", scheduler_args={"plan_text": PLAN})
    agree_settings(r, "host-c-1", other.shared(), time.time())


def test_a_coordinator_that_stopped_cleanly_does_not_block_a_restart(r, redis_url):
    """Its heartbeat goes with it: a restart with other settings need not wait it out."""
    first = Coordinator(r, make_settings(redis_url))
    with running(first, block_ms=10, join_s=10):
        wait_for(lambda: r.hexists(keys.COORDINATORS, first.consumer))
    assert not r.hexists(keys.COORDINATORS, first.consumer)
    assert not r.hexists(keys.COORDINATOR_SETTINGS, first.consumer)
    other = make_settings(redis_url, "PointSolution", scheduler_args={"plan_text": PLAN})
    agree_settings(r, "host-c-1", other.shared(), time.time())  # no ConfigError


def test_settings_are_recorded_again_after_redis_lost_its_data(r, redis_url):
    """A Redis restarted without persistence forgets them; the next beat records them again."""
    first = Coordinator(r, make_settings(redis_url, "tests.toy_schedulers:StepDown"))
    with running(first, block_ms=10, join_s=10):
        wait_for(lambda: r.hexists(keys.COORDINATOR_SETTINGS, first.consumer))
        r.flushall()  # what the running coordinator sees of a restart without persistence
        # Both: a FLUSHALL that lands inside a beat's pipeline leaves its settings without its
        # beat until the next round.
        wait_for(
            lambda: (
                r.hexists(keys.COORDINATOR_SETTINGS, first.consumer)
                and r.hexists(keys.COORDINATORS, first.consumer)
            ),
            10,
        )
        other = make_settings(redis_url, "PointSolution", scheduler_args={"plan_text": PLAN})
        with pytest.raises(ConfigError, match=f"coordinator {first.consumer} \\(running"):
            agree_settings(r, "host-c-1", other.shared(), time.time())


def test_a_beat_stamped_just_after_the_check_reads_no_negative_age(r, redis_url):
    # The running coordinator beat a few ms after the starting one took the server's time:
    # "last round -0.0 s ago".
    now = time.time()
    first = make_settings(redis_url, "tests.toy_schedulers:StepDown")
    agree_settings(r, "host-a-1", first.shared(), now)
    beat(r, "host-a-1", now + 0.004)
    other = make_settings(redis_url, "PointSolution", scheduler_args={"plan_text": PLAN})
    with pytest.raises(ConfigError) as caught:
        agree_settings(r, "host-b-1", other.shared(), now)
    assert "(running: last round 0.0 s ago)" in str(caught.value)


def _run_briefly(coordinator: Coordinator) -> BaseException | None:
    """Run ``coordinator`` in a thread for at most 5 s; what it raised (None: it ran)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            coordinator.run()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(5)
    coordinator.stop_event.set()
    thread.join(10)
    return raised[0] if raised else None


def test_a_socket_timeout_that_cuts_the_blocking_reads_is_refused_at_start(redis_url):
    # ?socket_timeout=1 timed out every idle read of 1 s: the coordinator only retried with
    # backoff, handling entries seconds late, with one warning in its log.
    sep = "&" if "?" in redis_url else "?"
    short = connect(f"{redis_url}{sep}socket_timeout=1")
    failed = _run_briefly(Coordinator(short, make_settings(redis_url)))
    assert isinstance(failed, ConfigError), failed
    assert "socket_timeout=1 s (the Redis URL's ?socket_timeout=) is too short" in str(failed)
    assert "give at least ?socket_timeout=2, or leave it out (30 s)" in str(failed)
    enough = connect(f"{redis_url}{sep}socket_timeout=2")
    assert _run_briefly(Coordinator(enough, make_settings(redis_url))) is None
