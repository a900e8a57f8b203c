"""The hook's background threads end when told to, and lose nothing without saying so.

A silent network (packets dropped, no connection refused) is played by
:class:`~tests.silent_proxy.SilentProxy` in front of the suite's real Redis.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest

from protocol import keys
from protocol.exceptions import CoordinatorUnavailableError, GPUError, ProtocolError
from protocol.models import JobConfig, JobInfo, ProfilingResult
from protocol.store import JobStore
from tests.fake_nvml import read_log
from tests.helpers import ROOT, free_ports, result, subprocess_env, wait_for
from tests.rank_helpers import make_hook, run_step, step_until
from tests.silent_proxy import SilentProxy
from worker_client.gpu.frequency import DryRunFrequencyController
from worker_client.hook.joining import FINISH_TIMEOUT_S
from worker_client.hook.session import CoordinatorClient
from worker_client.hook.watchers import STOP_TIMEOUT_S, ResultReporter, ScheduleWatcher


def new_job(r, job_id: str) -> None:
    """A one-rank job straight in the store."""
    job = JobInfo(job_id=job_id, pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    JobStore(r).create_job(job, JobConfig(scheduler="x"), "1-0")


def test_stop_ends_a_watcher_whose_heartbeat_hangs_on_a_silent_network(r, redis_url):
    new_job(r, "quiet")
    with SilentProxy(redis_url) as proxy:
        # The client's own socket time-out is long (reply_timeout + 30 s): registrations
        # block for reply_timeout.
        client = CoordinatorClient(proxy.url, reply_timeout=10)
        watcher = ScheduleWatcher(client, "quiet", rank=0, version=0, heartbeat_interval=0.2)
        # The network goes silent as the first heartbeat goes out.
        proxy.silence_from(keys.job_alive("quiet").encode())
        watcher.start()
        wait_for(lambda: proxy.dropped > 0, 10, "the heartbeat dropped by the network")
        time.sleep(0.2)  # the heartbeat is waiting for its reply
        started = time.monotonic()
        watcher.stop()
        took = time.monotonic() - started
        assert took < STOP_TIMEOUT_S + 0.5
        assert not watcher.is_alive(), "the watcher outlived stop()"
        assert watcher.error is None and watcher.outage.since is None
        client.close()
    assert r.zcard(keys.job_alive("quiet")) == 0  # no heartbeat got through, before or after


def test_results_after_the_reporter_gave_up_are_counted_and_said(caplog):
    # Nothing listens on the port: every report fails at once, until outage_timeout.
    client = CoordinatorClient(f"redis://127.0.0.1:{free_ports()[0]}/0")
    reporter = ResultReporter(client, "job-x", outage_timeout=0.5)
    with caplog.at_level(logging.WARNING, logger="worker_client.hook.watchers"):
        reporter.start()
        reporter.submit(result(0, 1))
        reporter.join(timeout=30)
        assert not reporter.is_alive()
        assert isinstance(reporter.error, CoordinatorUnavailableError)
        assert reporter.unsent == 1  # the result it was sending
        reporter.submit(result(0, 2))
        reporter.submit(result(0, 3))
        reporter.stop()
    client.close()
    assert (reporter.sent, reporter.unsent) == (0, 3)
    lines = [rec.getMessage() for rec in caplog.records]
    assert any("1 profiling result(s) of job job-x not sent" in line for line in lines), lines
    later = [line for line in lines if "the reporter has stopped" in line]
    assert len(later) == 2 and "3 result(s) not sent so far" in later[-1], lines
    assert all("\n" not in line for line in lines)


class _Broken(CoordinatorClient):
    """A client whose report fails with what no Redis error is (a bug, say)."""

    def background_client(self, socket_timeout: float = 30.0) -> CoordinatorClient:
        return self

    def report(self, job_id: str, result: ProfilingResult) -> None:
        raise ValueError("cannot encode this result")


def test_a_reporter_that_fails_unexpectedly_keeps_the_error_and_counts_its_results(
    redis_url, caplog
):
    client = _Broken(redis_url)
    reporter = ResultReporter(client, "job-y")
    with caplog.at_level(logging.WARNING, logger="worker_client.hook.watchers"):
        reporter.start()
        reporter.submit(result(0, 1))
        reporter.join(timeout=10)
        reporter.submit(result(0, 2))
        reporter.stop()
    client.close()
    assert isinstance(reporter.error, ValueError)  # raised by the hook at the next step end
    assert (reporter.sent, reporter.unsent) == (0, 2)
    assert "ValueError: cannot encode this result" in caplog.text


def test_close_on_a_silent_network_is_bounded_and_counts_the_result_in_flight(
    gloo, hook_service, redis_url, caplog
):
    _coord, start_worker = hook_service
    start_worker()
    with SilentProxy(redis_url) as proxy:
        hook = make_hook(proxy.url, DryRunFrequencyController(0), report_every=1)
        try:
            hook.reporter.flush_timeout = 1.0
            step_until(hook, lambda: hook.schedule.version == 2, 20, "version 2")
            wait_for(lambda: hook.reporter.sent == 1, 10, "version 1's result")
            proxy.silence()
            run_step(hook)  # version 2's result: its XADD is lost, or it waits behind one
        finally:
            started = time.monotonic()
            hook.close()
        took = time.monotonic() - started
    # The flush (1 s), then the result in flight is cut off; the rank is not marked finished.
    assert took < 1.0 + 2 * STOP_TIMEOUT_S + 1.0, took
    assert not hook.reporter.is_alive() and not hook.watcher.is_alive()
    assert (hook.reporter.sent, hook.reporter.unsent) == (1, 1)
    assert "profiling result(s) of job" in caplog.text and "after close" in caplog.text


def test_close_does_not_wait_minutes_to_mark_the_rank_finished_on_a_silent_network(
    gloo, hook_service, redis_url, caplog
):
    _coord, start_worker = hook_service
    start_worker()
    with SilentProxy(redis_url) as proxy:
        hook = make_hook(proxy.url, DryRunFrequencyController(0), report_every=1000)
        try:
            run_step(hook)
            proxy.silence()  # before the watcher could notice: close tries to finish the rank
        finally:
            started = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="worker_client.hook.optimizer"):
                hook.close()
        took = time.monotonic() - started
    assert took < STOP_TIMEOUT_S + FINISH_TIMEOUT_S + 2.0, took
    assert "could not mark job" in caplog.text and "deleted when idle" in caplog.text


class _FailingReset(DryRunFrequencyController):
    """A controller whose clocks cannot be reset at stop."""

    def stop(self) -> None:
        super().stop()
        raise GPUError("cannot reset the clocks of GPU 0")


def test_a_close_that_fails_still_stops_and_closes_everything_else(gloo, hook_service, redis_url):
    _coord, start_worker = hook_service
    start_worker()
    with SilentProxy(redis_url) as proxy:  # counts the hook's connections
        hook = make_hook(proxy.url, _FailingReset(0))
        run_step(hook)
        with pytest.raises(GPUError, match="cannot reset the clocks"):
            hook.close()
        assert not hook.reporter.is_alive() and not hook.watcher.is_alive()
        wait_for(lambda: proxy.open == 0, 5, "every connection of the hook closed")
        hook.close()  # closed already: nothing more to do, nothing raised


class _OnceFaultyEnergy:
    """An energy source whose first energy() fails (a bug of the source, not a glitch)."""

    def __init__(self) -> None:
        self.failed = False

    def mark(self) -> float:
        return time.monotonic()

    def energy(self, start_mark: float, end_mark: float) -> float:
        if not self.failed:
            self.failed = True
            raise RuntimeError("energy source broke")
        return 1.0


def test_training_goes_on_after_a_step_end_raised_a_background_error(gloo, hook_service, redis_url):
    _coord, start_worker = hook_service
    start_worker()
    hook = make_hook(
        redis_url, DryRunFrequencyController(0), report_every=1, energy_source=_OnceFaultyEnergy()
    )
    try:
        # The first result's building fails on the builder thread; a step end raises it,
        # after its step ran through.
        with pytest.raises(RuntimeError, match="energy source broke"):
            step_until(hook, lambda: False, 10, "the builder's error")
        steps = hook.steps
        # The caller may go on: the next step starts at the schedule's first instruction.
        for _ in range(3):
            run_step(hook)
        assert hook.steps == steps + 3
        # The version whose result was lost is measured again: the job goes on.
        step_until(hook, lambda: hook.schedule.version == 2, 20, "version 2")
    finally:
        hook.close()


def test_a_schedule_deleted_between_its_version_and_its_read_ends_no_watcher(r, redis_url):
    # The watcher reads the job's latest version, then that version's schedule. A job
    # deleted in between (idle GC, an operator, Redis restarted empty) used to end the
    # watcher with "no schedule version 1", raised into training; the next heartbeat says
    # the job is lost instead, and training goes on.
    new_job(r, "gone")
    r.set(keys.job_version("gone"), 1)
    client = CoordinatorClient(redis_url)
    watcher = ScheduleWatcher(client, "gone", rank=0, version=0, heartbeat_interval=60)
    read = watcher._client.latest_version

    def read_then_delete(job_id: str) -> int:
        version = read(job_id)
        JobStore(r).delete_job(job_id)
        return version

    watcher._client.latest_version = read_then_delete  # type: ignore[method-assign]
    watcher._take_newest(1)
    assert watcher.take() is None
    # Still there, version and all, but without the schedule: that is no race, but an error.
    new_job(r, "broken")
    r.set(keys.job_version("broken"), 1)
    watcher._client.latest_version = read  # type: ignore[method-assign]
    other = ScheduleWatcher(client, "broken", rank=0, version=0, heartbeat_interval=60)
    with pytest.raises(ProtocolError, match="no schedule version 1"):
        other._take_newest(1)
    watcher.stop()
    other.stop()
    client.close()


def test_a_training_rank_holds_two_redis_connections(gloo, hook_service, redis_url):
    """The watcher's and the reporter's: the one that joined the job is not kept idle.

    Each thread has connections of its own; the client that registered the rank kept its
    pooled connection open, idle, for the whole run: a third connection per rank (at
    Redis's default maxclients of 10000, about 3300 ranks instead of 5000).
    """
    _coord, start_worker = hook_service
    start_worker()
    with SilentProxy(redis_url) as proxy:
        hook = make_hook(proxy.url, DryRunFrequencyController(0), report_every=1)
        try:
            step_until(hook, lambda: hook.schedule.version == 2, 20, "version 2")
            wait_for(lambda: hook.reporter.sent >= 1, 10, "a result sent")
            time.sleep(0.2)  # a connection the proxy saw close is counted once it closed
            assert proxy.open == 2
        finally:
            hook.close()
        wait_for(lambda: proxy.open == 0, 5, "every connection of the hook closed")


def test_every_thread_the_hook_starts_is_a_daemon(gloo, hook_service, redis_url):
    """A thread that is not one holds the interpreter at exit, before the hook's own close.

    The result builder was a ThreadPoolExecutor's worker: a SIGTERM (KeyboardInterrupt) that
    landed while the first report started it left a thread the executor never told to end,
    and the process (examples/minimal_loop.py) hung at exit for ever.
    """
    _coord, start_worker = hook_service
    start_worker()
    before = set(threading.enumerate())
    hook = make_hook(redis_url, DryRunFrequencyController(0), report_every=1)
    try:
        step_until(hook, lambda: hook.schedule.version == 2, 20, "version 2 (a result built)")
        started = set(threading.enumerate()) - before
        assert started, "the hook started no thread"
        assert not [t.name for t in started if not t.daemon]
    finally:
        hook.close()


@pytest.mark.parametrize("mode", ["main", "mp-fork", "os-fork"])
def test_a_script_that_ends_without_close_sends_its_results_and_finishes_its_rank(
    hook_service, r, redis_url, tmp_path, mode
):
    # Zeus's hook has no close(): a script written for it ends without one. The hook's threads
    # are daemons, so without the hook's exit handler its queued results and the rank's
    # finished mark went down with the interpreter. A rank in a child forked by
    # multiprocessing ends without atexit; a plain fork's exit must not close the parent's hook.
    _coord, start_worker = hook_service
    start_worker()
    port = str(free_ports()[0])
    command = [sys.executable, "-m", "tests.exit_without_close", redis_url, port, mode]
    done = subprocess.run(
        command, env=subprocess_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    job_id, version, *fork = done.stdout.split()
    if mode == "os-fork":
        assert fork == ["fork-marked-finished=False"]
    # Marked before the process ended (each mark carries its rank's proof after the colon).
    assert r.zscore(keys.FINISHED_JOBS, job_id) is not None
    assert [m.partition(b":")[0] for m in r.smembers(keys.job_finished(job_id))] == [b"0"]
    results = keys.job_results(job_id, int(version))
    wait_for(lambda: r.hexists(results, "0"), 10, "the last result stored by the coordinator")
    assert done.stderr.count("closing the hook at exit (close() was not called)") == 1


def test_at_exit_the_hook_hands_its_last_clock_requests_over_before_the_controller_stops(
    hook_service, r, redis_url, tmp_path
):
    # The controller stopped itself at exit (its own atexit handler) before the hook's exit
    # close ran: the clock requests still waiting for their markers then failed ("clock
    # request of 1980 MHz failed: frequency controller for GPU 0 is stopped").
    _coord, start_worker = hook_service
    start_worker()
    log = tmp_path / "nvml.jsonl"
    command = [sys.executable, "-m", "tests.exit_without_close", redis_url]
    done = subprocess.run(
        [*command, str(free_ports()[0]), "events-nvml"],
        env=subprocess_env(tmp_path, FAKE_NVML_LOG=str(log)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "failed" not in done.stderr, done.stderr
    assert done.stderr.count("closing the hook at exit") == 1
    writes = [name for name, _ in read_log(log) if "Set" in name or "Reset" in name]
    # Requests the side process had not applied when told to stop are dropped: clocks reset.
    assert writes[-2:] == ["nvmlDeviceResetGpuLockedClocks", "nvmlDeviceResetMemoryLockedClocks"]


def test_a_urls_short_socket_timeout_cuts_no_blocking_read_into_an_outage(r, redis_url, caplog):
    # A URL's ?socket_timeout= wins over the hook's own: an idle watcher's 20 s read (and a
    # registration's wait for its reply) then timed out, and the watcher logged Redis as
    # unavailable, then back, every few seconds of a healthy run.
    new_job(r, "short")
    sep = "&" if "?" in redis_url else "?"
    client = CoordinatorClient(f"{redis_url}{sep}socket_timeout=1.5", reply_timeout=4)
    watcher = ScheduleWatcher(client, "short", rank=0, version=0, heartbeat_interval=60)
    caplog.set_level(logging.INFO)
    watcher.start()
    try:
        time.sleep(4)
        assert watcher.outage.since is None and watcher.error is None
    finally:
        watcher.stop()
    assert "unavailable" not in caplog.text
    # A registration nobody answers waits its whole reply_timeout, then says so (it said that
    # Redis did not answer within 1.5 s, or retried the read as an outage).
    started = time.monotonic()
    job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    with pytest.raises(CoordinatorUnavailableError, match="no coordinator answered"):
        client.register_job(job, "PointSolution")
    assert 3.5 < time.monotonic() - started < 8
    assert "unavailable" not in caplog.text
    client.close()
