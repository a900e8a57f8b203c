"""A new target iteration time travels through Redis and re-plans every rank (straggler case)."""

from __future__ import annotations

import logging

import msgpack
import pytest
from click.testing import CliRunner
from rq import Queue

from coordinator.cli import main
from coordinator.replay import LiveSchedulers
from coordinator.service import Coordinator
from coordinator.settings import PerseusSettings
from coordinator.tasks import advance_once
from protocol import keys
from protocol.constants import H100_GRAPHICS_CLOCKS
from protocol.exceptions import ConfigError, ProtocolError
from protocol.models import JobConfig, JobInfo, RankInfo, SetTarget
from protocol.store import JobStore
from schedulers.planning.choose import select_point
from schedulers.planning.frontier_files import load_frontier
from schedulers.planning.planner import plan_frontier
from schedulers.planning.synthetic_profile import synthetic_profile
from tests.helpers import coordinator_thread, drain, running, wait_first_task, wait_for
from worker_client.hook.session import CoordinatorClient


@pytest.fixture
def frontier_dir(tmp_path):
    out = tmp_path / "frontier"
    plan_frontier(synthetic_profile(2, stride=20), 2, 2, out_dir=out)
    return out


@pytest.mark.parametrize("source", ["folder", "profile"])
def test_target_through_redis_switches_plan(r, redis_url, frontier_dir, source):
    # A planner folder, or the profile that every worker plans in memory (the same plans).
    # Either is the operator's setting: a job may not name server paths.
    args = {"frontier_dir": str(frontier_dir)}
    if source == "profile":
        args = {"profile": str(frontier_dir / "profile.csv"), "microbatches": 2}
    settings = PerseusSettings(
        redis_url=redis_url, scheduler="FrontierScheduler3D", scheduler_args=args
    )
    coord = Coordinator(r, settings)
    with running(coord):
        client = CoordinatorClient(redis_url, reply_timeout=5)
        job = JobInfo(pp_degree=2, dp_degree=2, tp_degree=1, world_size=4)
        job_id = client.register_job(job)
        for rank in range(4):
            client.register_rank(
                job_id,
                RankInfo(
                    rank=rank,
                    dp_rank=rank // 2,
                    pp_rank=rank % 2,
                    tp_rank=0,
                    available_frequencies=list(H100_GRAPHICS_CLOCKS),
                ),
            )
        wait_first_task(r, job_id)
        drain(r)
        first = client.wait_schedule(job_id, rank=1, timeout=5)
        frontier = load_frontier(frontier_dir)
        fastest = frontier.points[-1]

        # A straggler makes every iteration 30% slower: aim at that time instead.
        straggler = fastest.iteration_time * 1.3
        result = CliRunner().invoke(
            main, ["target", job_id, str(straggler), "--redis-url", redis_url]
        )
        assert result.exit_code == 0, result.output
        store = JobStore(r)
        wait_for(lambda: Queue(keys.RQ_QUEUE, connection=r).count, 10, "the target's task")
        drain(r)
        second = client.wait_schedule(job_id, rank=1, newer_than=1, timeout=5)
        assert second.version == 2
        expected, _, _ = select_point(frontier, "straggler", straggler)
        assert expected.iteration_time <= straggler
        assert expected.plan != fastest.plan and second.frequencies != first.frequencies
        # Every rank of a stage got the same new plan line; the journal records the control.
        assert store.schedule(job_id, 2, 3).frequencies == second.frequencies
        assert store.journal(job_id)[-1].controls_upto == 1
        assert [m.iteration_time for m in store.controls(job_id)] == [straggler]

        # Once the job is finished no rank runs another version: a target is refused, not
        # turned into versions for nobody.
        result = CliRunner().invoke(main, ["jobs", "finish", job_id, "--redis-url", redis_url])
        assert result.exit_code == 0, result.output
        result = CliRunner().invoke(main, ["target", job_id, "1.0", "--redis-url", redis_url])
        assert result.exit_code == 1 and f"job {job_id} is finished" in result.output
        sent = r.xrange(keys.CONTROL_STREAM)  # nothing after the first target (or trimmed)
        assert not sent or sent[-1][0] == r.xrange(keys.job_control(job_id))[-1][0]


def test_target_for_unknown_job_and_bad_value(r, redis_url):
    coord = Coordinator(r, PerseusSettings(redis_url=redis_url, scheduler=""))
    with running(coord):
        result = CliRunner().invoke(main, ["target", "nope", "0", "--redis-url", redis_url])
        assert result.exit_code == 2 and "must be a positive number" in result.output
        # The command checks the job first; a target that reaches the stream anyway (the job
        # went away meanwhile) is dead-lettered.
        result = CliRunner().invoke(main, ["target", "nope", "1.5", "--redis-url", redis_url])
        assert result.exit_code == 1 and "nope" in result.output
        CoordinatorClient(redis_url).set_target("nope", 1.5)
        wait_for(lambda: r.xlen(keys.DEADLETTER_STREAM), 10, "the dead letter")
        reason = r.xrange(keys.DEADLETTER_STREAM)[-1][1][b"reason"]
        assert b"unknown job id 'nope'" in reason


@pytest.mark.parametrize("seconds", ["1e300", "1e-300", "inf", "nan", "86401", "-0.0"])
def test_an_impossible_target_is_refused_by_the_cli_and_the_client(r, redis_url, seconds):
    """1e300 and 1e-300 s were sent as targets: a day at most, a microsecond at least."""
    result = CliRunner().invoke(main, ["target", "nope", seconds, "--redis-url", redis_url])
    assert result.exit_code == 2, result.output
    assert "from 1e-06 to 86400 (a day)" in result.output and "SECONDS" in result.output
    with pytest.raises(ConfigError, match=r"^bad target for job 'nope': iteration_time: "):
        CoordinatorClient(redis_url).set_target("nope", float(seconds))
    for bad in (True, "1.0"):  # True was sent as 1.0 s
        with pytest.raises(ConfigError, match="iteration_time: Input should be a valid number"):
            CoordinatorClient(redis_url).set_target("nope", bad)  # type: ignore[arg-type]
    assert r.xlen(keys.CONTROL_STREAM) == 0


def test_a_raw_target_entry_out_of_range_is_dead_lettered_and_the_coordinator_goes_on(r, redis_url):
    coord = Coordinator(r, PerseusSettings(redis_url=redis_url, scheduler=""))
    with coordinator_thread(coord) as thread:
        for seconds in (1e300, 1e-300):  # what a client that checks nothing sends
            data = msgpack.packb(
                {"kind": "set_target", "job_id": "nope", "iteration_time": seconds}
            )
            r.xadd(keys.CONTROL_STREAM, {"kind": "set_target", "job_id": "nope", "data": data})
        wait_for(lambda: r.xlen(keys.DEADLETTER_STREAM) == 2, 10, "the dead letters")
        reasons = [f[b"reason"] for _, f in r.xrange(keys.DEADLETTER_STREAM)]
        assert b"iteration_time: Input should be less than or equal to 86400" in reasons[0]
        assert b"iteration_time: Input should be greater than or equal to 0.000001" in reasons[1]
        CoordinatorClient(redis_url).set_target("nope", 1.5)  # the next entry is still read
        wait_for(lambda: r.xlen(keys.DEADLETTER_STREAM) == 3, 10, "the third dead letter")
        assert b"unknown job id 'nope'" in r.xrange(keys.DEADLETTER_STREAM)[-1][1][b"reason"]
        assert thread.is_alive()


def test_a_control_message_handled_after_a_newer_one_is_dead_lettered_not_dropped(r):
    """Left pending, then claimed after a newer target was applied: said so, nothing lost."""
    store = JobStore(r)
    job = JobInfo(job_id="late", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    store.create_job(job, JobConfig(scheduler="tests.toy_schedulers:StepDown"), "1-1")
    assert store.add_control(SetTarget(job_id="late", iteration_time=2.0), "9-0")
    assert not store.add_control(SetTarget(job_id="late", iteration_time=2.0), "9-0")  # again
    with pytest.raises(ProtocolError, match="control message 5-0 of job late is older"):
        store.add_control(SetTarget(job_id="late", iteration_time=1.0), "5-0")
    assert [m.iteration_time for m in store.controls("late")] == [2.0]


def test_a_replayed_target_that_no_plan_meets_is_not_warned_about_again(r, frontier_dir, caplog):
    store = JobStore(r)
    job = JobInfo(job_id="fast", pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    config = JobConfig(
        scheduler="FrontierScheduler", scheduler_args={"frontier_dir": str(frontier_dir)}
    )
    store.create_job(job, config, "1-1")
    for rank in range(2):
        store.add_rank(
            job,
            RankInfo(
                rank=rank,
                dp_rank=0,
                pp_rank=rank,
                tp_rank=0,
                available_frequencies=list(H100_GRAPHICS_CLOCKS),
            ),
        )
    cache = LiveSchedulers()
    assert advance_once(store, "fast", cache) == 1
    fastest = min(load_frontier(frontier_dir).pareto, key=lambda p: p.iteration_time)
    slower = fastest.iteration_time * 1.3  # some plan meets it: another plan, version 2
    store.add_control(SetTarget(job_id="fast", iteration_time=slower), "8-0")
    assert advance_once(store, "fast", cache) == 2
    store.add_control(SetTarget(job_id="fast", iteration_time=fastest.iteration_time / 10), "9-0")
    with caplog.at_level(logging.WARNING, logger="schedulers.frontier"):
        assert advance_once(store, "fast", cache) == 3
    assert caplog.text.count("faster than every plan") == 1
    caplog.clear()
    # A worker without the scheduler (a restart, or --fork) replays the target: no warning,
    # the same plan.
    fresh = LiveSchedulers()
    with caplog.at_level(logging.WARNING, logger="schedulers.frontier"):
        live = fresh.get(store, store.job_state("fast"))
    assert caplog.text == "" and live.scheduler.current.plan == fastest.plan
    assert live.scheduler.replaying is False


def test_a_target_the_scheduler_refuses_is_logged_and_the_job_goes_on(r, caplog):
    """Any rank may send a target: one the scheduler refuses must not fail the job."""
    store = JobStore(r)
    job = JobInfo(job_id="picky", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    store.create_job(job, JobConfig(scheduler="tests.toy_schedulers:RefusesSlowTargets"), "1-1")
    clocks = list(H100_GRAPHICS_CLOCKS)
    store.add_rank(
        job, RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=clocks)
    )
    cache = LiveSchedulers()
    assert advance_once(store, "picky", cache) == 1
    store.add_control(SetTarget(job_id="picky", iteration_time=20.0), "8-0")
    with caplog.at_level(logging.WARNING, logger="coordinator.replay"):
        advance_once(store, "picky", cache)
    assert "job picky: target of 20 s refused, the job goes on: no plan for" in caplog.text
    assert store.job_error("picky") == ""
    store.add_control(SetTarget(job_id="picky", iteration_time=2.0), "9-0")
    version = advance_once(store, "picky", cache)
    assert version >= 2 and store.job_error("picky") == ""
    assert cache.get(store, store.job_state("picky")).scheduler.targets == [2.0]
    # A worker that rebuilds the scheduler refuses the same target again, silently.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="coordinator.replay"):
        rebuilt = LiveSchedulers().get(store, store.job_state("picky"))
    assert rebuilt.scheduler.targets == [2.0] and "refused" not in caplog.text


def test_a_target_logged_before_the_bounds_is_replayed_not_a_job_failure(r, caplog):
    """A job's control log holds what was accepted when it was appended; replays feed it.

    Targets were only checked to be > 0 before the microsecond-to-a-day bounds: a job that
    took one outside them (its scheduler refused it, or planned for it) must not fail when a
    worker (an upgraded one, say) rebuilds its scheduler from the log.
    """
    store = JobStore(r)
    job = JobInfo(job_id="old", pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    store.create_job(job, JobConfig(scheduler="tests.toy_schedulers:RefusesSlowTargets"), "1-1")
    clocks = list(H100_GRAPHICS_CLOCKS)
    store.add_rank(
        job, RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=clocks)
    )
    cache = LiveSchedulers()
    assert advance_once(store, "old", cache) == 1
    # As an earlier version appended them: no bounds but > 0.
    for seconds, entry in ((1e-9, "7-0"), (1e300, "8-0")):
        logged = SetTarget.model_construct(job_id="old", iteration_time=seconds)
        assert store.add_control(logged, entry)
    assert [m.iteration_time for m in store.controls("old")] == [1e-9, 1e300]
    with caplog.at_level(logging.WARNING, logger="coordinator.replay"):
        advance_once(store, "old", cache)
    assert store.job_error("old") == ""
    assert "target of 1e+300 s refused, the job goes on" in caplog.text
    # A worker that rebuilds the scheduler replays both: the same targets as the first.
    rebuilt = LiveSchedulers().get(store, store.job_state("old"))
    assert rebuilt.scheduler.targets == cache.get(store, store.job_state("old")).scheduler.targets
    assert rebuilt.scheduler.targets == [1e-9]
