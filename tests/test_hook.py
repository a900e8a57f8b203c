"""PerseusOptimizer in one process (gloo, world size 1) against a real Redis and coordinator."""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from protocol import keys
from protocol.exceptions import (
    ConfigError,
    CoordinatorUnavailableError,
    PerseusError,
    ScheduleError,
)
from protocol.store import JobStore
from tests.helpers import wait_for
from tests.rank_helpers import make_hook, run_step, step_until
from worker_client.gpu.frequency import DryRunFrequencyController
from worker_client.hook.optimizer import PerseusOptimizer


@contextmanager
def _worker_and_hook(
    hook_service: tuple[Any, Callable[[], None]],
    redis_url: str,
    controller: Any = None,
    **kw: Any,
) -> Iterator[PerseusOptimizer]:
    """Start a `perseus worker` and a one-rank hook; close the hook at the end, whatever happens.

    Args:
        hook_service: The ``hook_service`` fixture (coordinator, worker starter).
        redis_url: Where the hook connects.
        controller: The hook's controller; a dry-run one for GPU 0 if not given.
        **kw: More :class:`PerseusOptimizer` arguments (``report_every``, ...).
    """
    _coord, start_worker = hook_service
    start_worker()
    if controller is None:
        controller = DryRunFrequencyController(0)
    hook = make_hook(redis_url, controller, **kw)
    try:
        yield hook
    finally:
        hook.close()


def _announce_then_reach_version_2(
    hook: PerseusOptimizer, r: Any, caplog: pytest.LogCaptureFixture, *versions: str
) -> None:
    """Add ``versions`` to the job's updates stream; the watcher skips them, training goes on.

    Each entry is read (the watcher warns about it) while the hook still runs version 1, then
    version 1 is reported and version 2 arrives as usual; the watcher never fails.
    """
    assert hook.schedule.version == 1
    with caplog.at_level(logging.WARNING, logger="worker_client.hook.watchers"):
        for version in versions:
            r.xadd(keys.job_updates(hook.job_id), {"version": version})
        wait_for(
            lambda: all(v in caplog.text for v in versions) or hook.watcher.error is not None,
            10,
            "the entries to be read",
        )
        assert hook.watcher.error is None
        run_step(hook)  # reports version 1: version 2 follows
        step_until(hook, lambda: hook.schedule.version >= 2, 30, "version 2")
    assert hook.watcher.error is None


def test_swaps_only_between_steps(gloo, hook_service, redis_url):
    controller = DryRunFrequencyController(0)
    with _worker_and_hook(hook_service, redis_url, controller, report_every=1) as hook:
        assert hook.schedule.version == 1
        run_step(hook)  # reports version 1's result at its end

        def wait_for_new_version() -> None:
            deadline = time.monotonic() + 10
            while hook.watcher._pending is None:  # published and fetched in the background
                assert time.monotonic() < deadline, "no new version"
                time.sleep(0.01)

        # Version 2 arrives in the middle of step 2: step 2 still runs version 1 entirely.
        run_step(hook, between=wait_for_new_version)
        assert hook.schedule.version == 2 and hook.swaps == [(2, 2)]
        run_step(hook)
        freqs = [f for _, f in controller.records]
        assert freqs[:8] == [1980] * 8
        assert freqs[8:12] == [1965] * 4


def test_wrong_instruction_and_schedule_length_errors(gloo, hook_service, redis_url):
    with _worker_and_hook(hook_service, redis_url) as hook:
        hook.on_step_begin()
        hook.on_instruction_begin("forward")
        hook.on_instruction_end("forward")
        with pytest.raises(
            ScheduleError,
            match=r"expected instruction 'backward' but got 'forward' .*2 x forward, 2 x backward "
            r"per step; does the training loop run that many microbatches",
        ):
            hook.on_instruction_begin("forward")
        # A name that is no instruction was asked whether the loop runs that many microbatches.
        with pytest.raises(
            ScheduleError,
            match=r"'fwd' is no instruction of schedule version 1 "
            r"\(it has 'backward', 'forward'\)$",
        ):
            hook.on_instruction_begin("fwd")
        hook.on_step_begin()
        hook.order.restart(hook.schedule)
        # A RuntimeError as well, as Zeus raises: a loop written for Zeus still catches it.
        with pytest.raises(RuntimeError, match="still expects 'forward' at 1980 MHz") as caught:
            hook.on_step_end()
        assert isinstance(caught.value, ScheduleError)
        hook.order.restart(hook.schedule)
        with pytest.raises(ScheduleError, match="has only 4 instructions"):
            run_step(hook, names=("forward", "backward") * 3)


def test_a_refused_instruction_leaves_the_step_where_it_was(gloo, hook_service, redis_url):
    """The refused call used up the instruction the schedule expected in its place.

    A loop that caught the ScheduleError and ran the right instruction was then refused its
    step's last one (or, one short, ended the step without it unsaid).
    """
    with _worker_and_hook(hook_service, redis_url) as hook:
        hook.on_step_begin()  # the schedule: forward, backward, forward, backward
        hook.on_instruction_begin("forward")
        hook.on_instruction_end("forward")
        with pytest.raises(ScheduleError, match="expected instruction 'backward'"):
            hook.on_instruction_begin("forward")
        for name in ("backward", "forward", "backward"):
            hook.on_instruction_begin(name)
            hook.on_instruction_end(name)
        hook.on_step_end()
        assert hook.steps == 1


def test_hooks_called_out_of_order_say_what_was_expected(gloo, hook_service, redis_url):
    """A forgotten on_step_begin or on_instruction_end measured nothing, or failed the job."""
    with _worker_and_hook(hook_service, redis_url) as hook:
        with pytest.raises(ScheduleError, match=r"no step is open: call on_step_begin\(\) first"):
            hook.on_instruction_begin("forward")
        hook.on_step_begin()
        hook.on_instruction_begin("forward")
        message = r"on_instruction_begin\('backward'\), but 'forward' is still open: call"
        with pytest.raises(ScheduleError, match=message):
            hook.on_instruction_begin("backward")
        with pytest.raises(ScheduleError, match=r"on_step_end\(\), but 'forward' is still open"):
            hook.on_step_end()
        with pytest.raises(
            ScheduleError, match="on_instruction_end\\('backward'\\), but 'forward'"
        ):
            hook.on_instruction_end("backward")
        hook.on_instruction_end("forward")
        with pytest.raises(ScheduleError, match="no instruction is open"):
            hook.on_instruction_end("forward")
        hook.abandon_step()
        run_step(hook)  # a step in order still runs
        assert hook.steps == 1
    with pytest.raises(ScheduleError, match=r"on_step_begin\(\) after close\(\)"):
        hook.on_step_begin()


def test_a_step_begun_again_starts_at_the_first_instruction(gloo, hook_service, redis_url):
    """A step given up halfway (a CUDA OOM the loop catches, say) and begun again.

    The step went on from where the abandoned one stopped: its first instruction was refused
    as if the training loop ran too few microbatches.
    """
    with _worker_and_hook(hook_service, redis_url) as hook:
        hook.on_step_begin()
        hook.on_instruction_begin("forward")
        hook.on_instruction_end("forward")
        run_step(hook)  # begun again, without on_step_end: the whole schedule from the start
        assert hook.steps == 1
        run_step(hook)
        assert hook.steps == 2


def test_a_step_ended_without_being_begun_says_so(gloo, hook_service, redis_url):
    """It said the schedule still expected the step's first instruction."""
    with _worker_and_hook(hook_service, redis_url) as hook:
        run_step(hook)
        message = r"on_step_end\(\), but no step is open: call on_step_begin\(\) first"
        with pytest.raises(ScheduleError, match=message):
            hook.on_step_end()
        run_step(hook)  # the next step runs as usual
        assert hook.steps == 2


def test_first_schedule_timeout_is_clear(gloo, hook_service, redis_url):
    # No worker runs: the coordinator registers the job but nobody computes a schedule.
    with pytest.raises(CoordinatorUnavailableError, match="are `perseus worker` processes running"):
        make_hook(redis_url, DryRunFrequencyController(0), schedule_timeout=1)


def test_a_short_schedule_timeout_bounds_the_registration_wait_too(gloo, redis_url):
    # No coordinator runs: the registration's reply never comes.
    start = time.monotonic()
    with pytest.raises(PerseusError, match="no coordinator answered register_job within 10 s"):
        make_hook(redis_url, DryRunFrequencyController(0), schedule_timeout=2)
    assert time.monotonic() - start < 30  # not the 60 s of a registration's default wait
    with pytest.raises(ValueError, match="schedule_timeout must be > 0 seconds, got 0"):
        make_hook(redis_url, DryRunFrequencyController(0), schedule_timeout=0)


def test_invalid_job_is_refused_before_anything_starts(gloo, redis_url):
    with pytest.raises(PerseusError, match="world_size=3"):
        make_hook(redis_url, DryRunFrequencyController(0), world_size=3)


def test_rank_and_world_size_must_fit_the_process_group(gloo, r, redis_url):
    # A local rank passed as the global one left no rank 0 to register the job: every rank
    # failed with "rank 0 could not register the job: None".
    with pytest.raises(ConfigError, match=r"rank=1 but this process is rank 0 of torch"):
        make_hook(redis_url, DryRunFrequencyController(0), rank=1)
    # A world_size larger than the group: the job would wait for ranks that never come.
    with pytest.raises(ConfigError, match=r"world_size=2 but torch.distributed's default group"):
        make_hook(redis_url, DryRunFrequencyController(0), world_size=2)
    assert not r.keys("perseus:job:*")  # no job registered


def test_heartbeats_keep_a_quiet_job_from_idle_deletion(gloo, hook_service, r, redis_url):
    coord, _start_worker = hook_service
    # Nothing is ever reported (report_every is huge): only heartbeats show the job is alive.
    with _worker_and_hook(
        hook_service, redis_url, report_every=10**6, heartbeat_interval=0.2
    ) as hook:
        coord.settings = coord.settings.model_copy(
            update={"max_job_idle_time": 2, "reconcile_interval": 0.1}
        )
        # Over twice the idle time, with room for a heartbeat that a loaded machine delays.
        end = time.monotonic() + 5.0
        step_until(hook, lambda: time.monotonic() > end, 15, "5 s of training")
        assert r.exists(keys.job_info(hook.job_id)) and not hook.watcher.job_lost
    # Training ended: no more heartbeats, and the idle job is deleted.
    deadline = time.monotonic() + 10
    while r.zscore(keys.JOBS_INDEX, hook.job_id) is not None:
        assert time.monotonic() < deadline, "idle job was not deleted"
        time.sleep(0.05)
    assert not r.exists(keys.job_info(hook.job_id))


def test_heartbeat_notices_a_deleted_job_and_training_goes_on(gloo, hook_service, r, redis_url):
    with _worker_and_hook(hook_service, redis_url, heartbeat_interval=0.2) as hook:
        run_step(hook)
        assert JobStore(r).delete_job(hook.job_id)
        step_until(hook, lambda: hook.watcher.job_lost, 10, "the watcher to notice")
        assert hook.schedule.version == 1
        # The heartbeat never brings a deleted job back into the index.
        assert r.zscore(keys.JOBS_INDEX, hook.job_id) is None
        run_step(hook)


def test_a_malformed_update_is_skipped_and_the_watcher_goes_on(
    gloo, hook_service, r, redis_url, caplog
):
    # On Redis 6.2 a rank's ACL user can write any job's updates stream: garbage there ended
    # the watcher with a bare ValueError, raised at the next step end.
    with _worker_and_hook(hook_service, redis_url, report_every=1) as hook:
        _announce_then_reach_version_2(hook, r, caplog, "not-a-number", "-3")
    assert "'version' is b'not-a-number', not a positive integer" in caplog.text
    assert "'version' is b'-3'" in caplog.text


def test_an_update_announcing_a_version_never_published_is_skipped(
    gloo, hook_service, r, redis_url, caplog
):
    # A version beyond the job's version key was never published (a publish sets the key and
    # announces in one script): the watcher fetched it, found no schedule and ended with a
    # ProtocolError, which ended training at the next step end.
    with _worker_and_hook(hook_service, redis_url, report_every=1) as hook:
        _announce_then_reach_version_2(hook, r, caplog, "999999")
    assert "announces version 999999, never published" in caplog.text, caplog.text


def test_heartbeat_interval_must_be_positive(gloo, redis_url):
    with pytest.raises(ValueError, match="heartbeat_interval"):
        make_hook(redis_url, DryRunFrequencyController(0), heartbeat_interval=0)


def test_result_is_sent_again_when_redis_lost_its_version(gloo, hook_service, r, redis_url):
    coord, _start_worker = hook_service
    with _worker_and_hook(hook_service, redis_url, report_every=1) as hook:
        job = hook.job_id
        step_until(hook, lambda: hook.schedule.version == 2, 20, "version 2")
        # The worker publishes, then snapshots and settles the job: let it finish first.
        store = JobStore(r)
        wait_for(
            lambda: store.lease_holder(job) is None and r.zscore(keys.DUE_JOBS, job) is None,
            10,
            "the worker to settle version 2",
        )
        # Redis crashes within its fsync window: after its restart, version 2 never happened.
        [(entry_id, _)] = r.xrevrange(keys.job_updates(job), count=1)
        with r.pipeline() as pipe:
            pipe.set(keys.job_version(job), 1)
            pipe.delete(keys.job_schedule(job, 2))
            pipe.rpop(keys.job_journal(job))
            pipe.xdel(keys.job_updates(job), entry_id)
            pipe.execute()
        # The rank still runs version 2; its result is refused (dead-lettered, not lost).
        step_until(hook, lambda: r.xlen(keys.DEADLETTER_STREAM) == 1, 10, "the refusal")
        assert b"version 2" in r.xrange(keys.DEADLETTER_STREAM)[0][1][b"reason"]
        # The sweep notices the work and a worker publishes version 2 again; the rank sends
        # its result again, and the job moves on.
        coord.settings = coord.settings.model_copy(
            update={"stall_timeout": 0.2, "reconcile_interval": 0.1}
        )
        step_until(hook, lambda: hook.schedule.version == 3, 30, "version 3")
        assert hook.reporter.sent == 3  # version 1, version 2 refused, version 2 again
        assert [e.observed_version for e in JobStore(r).journal(job)] == [None, 1, 2]


def test_a_rank_that_fails_to_start_leaves_no_controller_process(gloo, hook_service, redis_url):
    # No worker: the first schedule never comes. The controller's side process (spawned
    # before the job was joined) must not outlive the failed constructor.
    with pytest.raises(CoordinatorUnavailableError, match="schedule"):
        make_hook(redis_url, "simulated", schedule_timeout=1.0)
    assert multiprocessing.active_children() == []


def test_a_rank_left_waiting_for_the_others_hooks_says_so(caplog):
    """Every rank's hook joins collectives: one rank that creates none leaves the rest waiting."""
    from worker_client.hook.joining import _said_if_slow

    with caplog.at_level(logging.WARNING, logger="worker_client.hook.joining"):
        with _said_if_slow(3, 0.05):
            time.sleep(0.5)
        assert "rank 3: still waiting after 0 s for the other ranks to create their hook" in (
            caplog.text
        )
        caplog.clear()
        with _said_if_slow(3, 0.5):
            pass
        time.sleep(0.7)
    assert caplog.text == ""


class _FailingEnergy:
    """An energy source whose energies cannot be read (a sensor that went away).

    Reading fails after a moment, as a monitor's wait for samples would: after the step end.
    """

    def mark(self) -> float:
        return 0.0

    def energy(self, start_mark: float, end_mark: float) -> float:
        time.sleep(0.5)
        raise RuntimeError("energy sensor gone")


def test_a_result_that_fails_to_build_after_the_last_step_is_not_lost_silently(
    gloo, hook_service, redis_url, caplog
):
    # The last step's report is built while close() waits: no step end follows to raise its
    # error, so close must say that the result was never sent, and why.
    with caplog.at_level(logging.WARNING, logger="worker_client.hook.optimizer"):
        with _worker_and_hook(
            hook_service, redis_url, report_every=1, energy_source=_FailingEnergy()
        ) as hook:
            run_step(hook)
    assert hook.reporter.sent == 0
    assert "energy sensor gone" in caplog.text and "version 1" in caplog.text, caplog.text
