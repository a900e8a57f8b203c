"""What a rank learns from the coordinator: a scheduler failure, and what its scheduler needs."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from rq import Queue

from coordinator.service import Coordinator
from coordinator.tasks import advance_job
from protocol import keys
from protocol.exceptions import ConfigError, JobFailedError
from protocol.models import JobConfig, JobInfo, RankInfo
from protocol.store import JobStore
from tests.helpers import (
    FREQS,
    TOY_SCHEDULER,
    make_settings,
    result,
    running,
    start_perseus,
    stop,
    wait_for,
)
from tests.rank_helpers import make_hook, run_step, step_until
from worker_client.gpu.frequency import DryRunFrequencyController
from worker_client.hook.session import CoordinatorClient
from worker_client.hook.watchers import ScheduleWatcher


@pytest.fixture
def serve(gloo, r, redis_url, tmp_path, monkeypatch) -> Iterator[object]:
    """Factory: a coordinator thread with ``scheduler`` (and its arguments) as default, and one
    `perseus worker`."""
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "simgpu"))
    workers = []
    with ExitStack() as coordinators:

        def make(scheduler: str, **scheduler_args: object) -> None:
            scheduler_args = scheduler_args or {"microbatches": 2}
            settings = make_settings(redis_url, scheduler, scheduler_args=scheduler_args)
            coordinators.enter_context(running(Coordinator(r, settings)))
            args = ["worker", "--simple", "--redis-url", redis_url]
            workers.append(start_perseus(args, tmp_path, "worker.log"))

        yield make
        stop(workers)


def test_a_scheduler_failure_is_logged_once_and_training_goes_on(serve, redis_url, caplog):
    serve("tests.toy_schedulers:FailsAfterFirst")
    hook = make_hook(redis_url, DryRunFrequencyController(0), report_every=1)
    try:
        with caplog.at_level(logging.ERROR, logger="worker_client.hook.watchers"):
            step_until(hook, lambda: hook.job_error, 30, "the job error to reach the hook")
            for _ in range(5):
                run_step(hook)  # Training goes on at version 1's clocks.
        assert "fails after its first version on purpose" in hook.job_error
        assert hook.schedule.version == 1
        logged = [r for r in caplog.records if "its scheduler failed" in r.getMessage()]
        assert len(logged) == 1, [r.getMessage() for r in logged]
    finally:
        hook.close()


def test_raise_on_job_error_stops_training_at_a_step_end(serve, redis_url):
    serve("tests.toy_schedulers:FailsAfterFirst")
    hook = make_hook(
        redis_url, DryRunFrequencyController(0), report_every=1, raise_on_job_error=True
    )
    try:
        with pytest.raises(JobFailedError, match="fails after its first version on purpose"):
            step_until(hook, lambda: False, 30, "JobFailedError")
    finally:
        hook.close()


@pytest.mark.parametrize("converged", [False, True], ids=["new-version", "observation-only"])
def test_the_job_error_clears_once_a_requeued_task_computes(
    serve, r, redis_url, tmp_path, caplog, converged
):
    """`hook.job_error` stayed set after the job recovered: only the failure was announced.

    The operator mends the cause and requeues the failed task, which publishes a new version
    or (a converged scheduler) records the observation; either ends the failure for the ranks.
    """
    flag = tmp_path / "flag"
    serve("tests.toy_schedulers:StepsUnlessFlagged", flag=str(flag), converged=converged)
    hook = make_hook(redis_url, DryRunFrequencyController(0), report_every=1)
    failed = Queue(keys.RQ_QUEUE, connection=r).failed_job_registry
    try:
        flag.touch()  # version 1 is in force; computing the next one fails
        step_until(hook, lambda: hook.job_error, 30, "the job error to reach the hook")
        assert "is in the way" in hook.job_error
        wait_for(lambda: failed.get_job_ids(), 30, "the task to fail")
        flag.unlink()
        requeue = [sys.executable, "-m", "rq.cli", "requeue", "-u", redis_url]
        subprocess.run([*requeue, "--queue", keys.RQ_QUEUE, "--all"], check=True, timeout=60)
        with caplog.at_level(logging.WARNING, logger="worker_client.hook.watchers"):
            step_until(hook, lambda: not hook.job_error, 30, "the job error to clear")
        assert "computes again; the failure (RuntimeError:" in caplog.text
        assert JobStore(r).job_error(hook.job_id) == ""
        if not converged:
            step_until(hook, lambda: hook.schedule.version >= 2, 30, "version 2 in force")
        else:
            assert hook.schedule.version == 1
    finally:
        hook.close()


def test_a_job_whose_scheduler_needs_instruction_energy_gets_it_without_asking(serve, redis_url):
    serve("tests.toy_schedulers:NeedsInstructionEnergy")
    hook = make_hook(redis_url, DryRunFrequencyController(0), report_every=1)
    try:
        assert hook.instruction_energy
        step_until(hook, lambda: hook.schedule.version >= 2, 30, "version 2")
        sent = hook._results.last_result
        assert sent is not None and set(sent.energy_breakdown) == {"forward", "backward"}
    finally:
        hook.close()
    with pytest.raises(ConfigError, match="needs per-instruction energy"):
        make_hook(redis_url, DryRunFrequencyController(0), instruction_energy=False)


def test_a_job_whose_scheduler_does_not_need_it_measures_steps_only(serve, redis_url):
    serve("tests.toy_schedulers:StepDown")
    hook = make_hook(redis_url, DryRunFrequencyController(0), report_every=1)
    try:
        assert not hook.instruction_energy
    finally:
        hook.close()


class GlitchyEnergy:
    """An energy source whose first ``bad`` readings are NaN (a glitching counter)."""

    def __init__(self, bad: int) -> None:
        self.bad, self.t = bad, 0.0

    def mark(self) -> float:
        self.t += 1.0
        return self.t

    def energy(self, start_mark: float, end_mark: float) -> float:
        if self.bad > 0:
            self.bad -= 1
            return math.nan
        return 5.0 * (end_mark - start_mark)


def test_unusable_measurements_are_measured_again_not_raised_into_training(
    serve, redis_url, caplog
):
    serve("tests.toy_schedulers:StepDown")
    hook = make_hook(
        redis_url, DryRunFrequencyController(0), report_every=1, energy_source=GlitchyEnergy(1)
    )
    try:
        with caplog.at_level(logging.WARNING, logger="worker_client.hook.optimizer"):
            step_until(hook, lambda: hook.schedule.version >= 2, 30, "version 2 after a glitch")
        assert "unusable, measuring again" in caplog.text
        assert hook.reporter.sent >= 1
    finally:
        hook.close()


def test_a_failure_after_publishing_is_logged_and_the_job_goes_on(r, tmp_path, caplog):
    """A dump that cannot be written (a file where its folder should be) fails no job."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    store = JobStore(r)
    job = JobInfo(job_id="dumps", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    config = JobConfig(scheduler=TOY_SCHEDULER, dump_dir=str(blocker / "dumps"))
    store.create_job(job, config, "1-1")
    info = RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS)
    store.add_rank(job, info)
    with caplog.at_level(logging.ERROR, logger="coordinator.tasks"):
        assert advance_job("dumps", conn=r) == [1]
        store.add_result(job, result(0, 1))
        assert advance_job("dumps", conn=r) == [2]
    assert store.job_error("dumps") == ""
    assert "saving its artifacts, dump or snapshot failed" in caplog.text


def _failed_then_mended(r, tmp_path, job_id: str, failing_now: bool) -> None:
    """A one-rank job whose scheduler failed after version 1 (and computed again, unless
    ``failing_now``), driven in-process as rq's worker and `rq requeue` would."""
    flag = tmp_path / "flag"
    store = JobStore(r)
    job = JobInfo(job_id=job_id, pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    config = JobConfig(
        scheduler="tests.toy_schedulers:StepsUnlessFlagged", scheduler_args={"flag": str(flag)}
    )
    store.create_job(job, config, "1-1")
    info = RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=FREQS)
    store.add_rank(job, info)
    assert advance_job(job_id, conn=r) == [1]
    store.add_result(job, result(0, 1))
    flag.touch()
    with pytest.raises(RuntimeError, match="is in the way"):
        advance_job(job_id, conn=r)
    assert "is in the way" in store.job_error(job_id)
    if not failing_now:
        flag.unlink()
        assert advance_job(job_id, conn=r) == [2]
        assert store.job_error(job_id) == ""


@pytest.mark.parametrize("failing_now", [False, True], ids=["mended", "failing"])
def test_a_rank_that_joins_after_a_failure_logs_only_the_jobs_state_now(
    r, redis_url, tmp_path, caplog, failing_now
):
    """A joining rank's watcher replays the updates stream from its start: it logged the
    scheduler's failure, and then its end, as news, although the job had long computed again
    (and where it still failed, it said so as if it had just happened). Now the replay is read
    as the job's state when the rank joined: a failure logged only if it still lasts, once."""
    _failed_then_mended(r, tmp_path, "mended", failing_now)
    version = JobStore(r).version("mended")
    client = CoordinatorClient(redis_url)
    watcher = ScheduleWatcher(client, "mended", rank=0, version=version, heartbeat_interval=60)
    try:
        with caplog.at_level(logging.WARNING, logger="worker_client.hook.watchers"):
            watcher.start()
            wait_for(lambda: version in watcher._seen, 10, "the watcher to read the stream")
        said = [m for m in (rec.getMessage() for rec in caplog.records) if "its scheduler" in m]
        if failing_now:
            assert len(said) == 1 and "its scheduler failed" in said[0], said
            assert "is in the way" in watcher.job_error
        else:
            assert said == [] and watcher.job_error == ""
    finally:
        watcher.stop()
        client.close()
