"""After the sweep: the profile CSV, planning once and serving the plan, snapshots and restores."""

from __future__ import annotations

import logging

import msgpack
import pytest

from coordinator.replay import LiveSchedulers
from coordinator.tasks import advance_once
from protocol import keys
from protocol.models import JobConfig
from protocol.store import JobStore
from schedulers.instruction_profiler import PROFILE_ARTIFACT, InstructionProfiler
from schedulers.planning.plan_file import read_plan_file
from schedulers.planning.profile_csv import read_profile_csv
from schedulers.profile_then import MEASURED_PROFILE, PLAN_MARKER
from tests.profiler_jobs import PROFILER, drive, make_job
from worker_client.simulated.gpu import (
    GRAPHICS_CLOCKS,
    synthetic_instruction_table,
)


def test_profile_csv_feeds_the_planner(tmp_path):
    from schedulers.planning.planner import plan_frontier

    job, ranks = make_job(pp=2, dp=2)
    table = synthetic_instruction_table(2, noise=0.002, seed=5)
    out = tmp_path / "profile.csv"
    clocks = list(GRAPHICS_CLOCKS[::6])
    drive(
        InstructionProfiler(job, ranks, out_path=str(out), microbatches=2, frequencies=clocks),
        job,
        table,
    )
    profile = read_profile_csv(out, num_stages=2)
    assert profile.replicas[(0, "forward", 1980)] == 2  # Two dp replicas per stage.
    result = plan_frontier(profile, 2, 2, out_dir=tmp_path / "plans", unit_time=0.001)
    assert len(result.points) >= 2
    assert result.points[-1].iteration_time <= result.points[0].iteration_time


def test_then_plans_once_and_serves_the_chosen_plan(tmp_path):
    job, ranks = make_job(pp=2, dp=2)
    table = synthetic_instruction_table(2, noise=0.002, seed=11)
    out, plans = tmp_path / "profile.csv", tmp_path / "plans"
    args = {
        "out_path": str(out),
        "microbatches": 2,
        "frequencies": list(GRAPHICS_CLOCKS[::8]),
        "then": {"out_dir": str(plans), "p2p_power": 100.0, "unit_time": 0.001},
    }
    first = InstructionProfiler(job, ranks, **args)
    versions, observed = drive(first, job, table)
    folder = plans / job.job_id  # each job plans in a folder of its own
    assert first.planned and (folder / PLAN_MARKER).is_file()
    assert (folder / MEASURED_PROFILE).read_bytes() == out.read_bytes()  # full form, as measured
    assert first.chosen is not None and first.chosen.policy == "no-slowdown"
    plan = read_plan_file(first.chosen.file)
    assert [s.frequencies for s in versions[-1]] == [plan.stages[r % 2] for r in range(4)]
    assert first.chosen.saving_j >= 0

    # An rq worker rebuilds the scheduler by replay: same schedules, no second planning run.
    stamp = (folder / "frontier.csv").stat().st_mtime_ns
    replayed = InstructionProfiler(job, ranks, **args)
    for schedules, results in zip(versions, observed, strict=False):
        assert replayed.next_schedule() == schedules
        replayed.observe(results)
    assert replayed.next_schedule() == versions[-1]
    assert not replayed.planned
    assert (folder / "frontier.csv").stat().st_mtime_ns == stamp

    # Another job of the same coordinator, another profile: its own folder, the first's intact.
    other_job = job.model_copy(update={"job_id": "job2"})
    other = InstructionProfiler(other_job, ranks, **args | {"out_path": str(tmp_path / "p2.csv")})
    drive(other, other_job, synthetic_instruction_table(2, noise=0.002, seed=12))
    assert other.planned and (plans / "job2" / "frontier.csv").is_file()
    assert (folder / "frontier.csv").stat().st_mtime_ns == stamp
    assert (folder / MEASURED_PROFILE).read_bytes() == out.read_bytes()


def test_then_without_p2p_power_warns_when_it_plans(tmp_path, caplog):
    """Planning with 0 W of P2P power counts waiting as free: `perseus optimize` warned."""
    job, ranks = make_job(pp=2, dp=1)
    table = synthetic_instruction_table(2, noise=0.002, seed=11)
    args = {"microbatches": 2, "frequencies": list(GRAPHICS_CLOCKS[::8])}
    then = {"out_dir": str(tmp_path / "plans"), "unit_time": 0.001}
    with caplog.at_level(logging.WARNING, logger="schedulers.instruction_profiler"):
        first = InstructionProfiler(job, ranks, **args, then=then)
        versions, observed = drive(first, job, table)
        replayed = InstructionProfiler(job, ranks, **args, then=then)  # planner folder cached
        for results in observed:
            replayed.next_schedule()
            replayed.observe(results)
        assert replayed.next_schedule() == versions[-1] and not replayed.planned
        other = job.model_copy(update={"job_id": "measured"})
        given = InstructionProfiler(other, ranks, **args, then=then | {"p2p_power": 0.0})
        drive(given, other, table)
    assert first.planned and given.planned
    notes = [rec.getMessage() for rec in caplog.records]
    assert notes == [
        "job job: InstructionProfiler's then.p2p_power not given: planning with 0 W while a GPU "
        "waits on its neighbour stage, so waiting counts as free and slower plans look cheaper "
        "than they are (Zeus's example assumed 70 W); measure it with `perseus profile-p2p`"
    ]


@pytest.mark.parametrize("at", [1, 4, "end"])
def test_a_restored_profiler_continues_the_same_sequence(tmp_path, at):
    """A snapshot taken after any version, restored into a new profiler, goes on identically."""
    job, ranks = make_job(pp=2, dp=2)
    table = synthetic_instruction_table(2, noise=0.005, seed=5)
    args = {"out_path": str(tmp_path / "profile.csv"), "microbatches": 2}
    versions, observed = drive(InstructionProfiler(job, ranks, **args), job, table)
    cut = len(observed) if at == "end" else at  # versions served before the snapshot

    original = InstructionProfiler(job, ranks, **args)
    for schedules, results in zip(versions[:cut], observed[:cut], strict=True):
        assert original.next_schedule() == schedules
        original.observe(results)
    assert original.next_schedule() == versions[cut]
    state = msgpack.unpackb(msgpack.packb(original.snapshot()), raw=False)  # as Redis keeps it

    restored = InstructionProfiler(job, ranks, **args)
    restored.restore(state)
    assert restored.next_schedule() == versions[cut]
    for schedules, results in zip(versions[cut + 1 :], observed[cut:], strict=False):
        for profiler in (original, restored):
            profiler.observe(results)
            assert profiler.next_schedule() == schedules
    assert restored.done and restored.artifacts() == original.artifacts()
    assert restored.sweeps == original.sweeps and restored.rank_data == original.rank_data
    # Converged alike: results no longer change anything.
    for profiler in (original, restored):
        profiler.observe(observed[-1])
        assert profiler.next_schedule() == versions[-1] and profiler.converged


def test_workers_that_restart_profile_from_snapshots_like_one_that_does_not(r, tmp_path):
    """Through Redis: a fresh cache every 3 versions rebuilds from the newest snapshot."""
    job, ranks = make_job(pp=2, dp=2)
    table = synthetic_instruction_table(2, noise=0.005, seed=7)
    args = {"microbatches": 2, "frequencies": list(GRAPHICS_CLOCKS[:12])}
    reference = InstructionProfiler(job, ranks, **args)
    versions, observed = drive(reference, job, table)  # (the table's noise is drawn per lookup)
    store = JobStore(r)
    job_info = job.model_copy(update={"job_id": "prof"})
    store.create_job(job_info, JobConfig(scheduler=PROFILER, scheduler_args=args), "1-1")
    for info in ranks:
        store.add_rank(job_info, info)
    cache = LiveSchedulers()
    for version in range(1, len(versions) + 1):
        if version % 3 == 0:
            cache = LiveSchedulers()  # a restarted worker
        assert advance_once(store, "prof", cache, snapshot_every=2) == version
        served = store.schedules("prof", version)
        assert [s.frequencies for s in served] == [s.frequencies for s in versions[version - 1]]
        for res in observed[version - 1] if version <= len(observed) else []:
            store.add_result(job_info, res)
    assert int(store.job_fields("prof", "snapshot_len")["snapshot_len"]) >= len(versions) - 2
    assert not r.exists(keys.job_results("prof", 1))  # consumed by a snapshot, deleted
    assert store.artifacts("prof")[PROFILE_ARTIFACT] == reference.csv_bytes()


def test_a_snapshot_of_another_job_shape_is_refused(tmp_path):
    job, ranks = make_job(pp=2, dp=2)
    profiler = InstructionProfiler(job, ranks, microbatches=2)
    profiler.next_schedule()
    state = profiler.snapshot()
    other = InstructionProfiler(job, ranks, microbatches=2, frequencies=list(GRAPHICS_CLOCKS[::8]))
    with pytest.raises(ValueError, match="other clocks"):
        other.restore(state)
