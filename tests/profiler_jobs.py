"""InstructionProfiler jobs in process: their shape, results computed from a table, a driver."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from schedulers.instruction_profiler import InstructionProfiler
from schedulers.planning.profile_csv import read_profile_csv
from worker_client.simulated.gpu import GRAPHICS_CLOCKS, InstructionTable

PROFILER = "schedulers.instruction_profiler:InstructionProfiler"
TOL = 0.02


def make_job(pp: int, dp: int) -> tuple[JobInfo, list[RankInfo]]:
    job = JobInfo(job_id="job", pp_degree=pp, dp_degree=dp, tp_degree=1, world_size=pp * dp)
    ranks = [
        RankInfo(
            rank=r,
            dp_rank=r // pp,
            pp_rank=r % pp,
            tp_rank=0,
            available_frequencies=list(GRAPHICS_CLOCKS),
        )
        for r in range(pp * dp)
    ]
    return job, ranks


def fake_results(
    schedules: list[FrequencySchedule],
    job: JobInfo,
    table: InstructionTable,
    iters: int = 3,
    warmup: int = 1,
    version: int = 1,
) -> list[ProfilingResult]:
    """What each rank's hook would report after running its schedule ``iters`` times."""
    out = []
    for sched in schedules:
        stage = sched.rank % job.pp_degree
        times: dict[str, list[list[float]]] = {"forward": [], "backward": []}
        energies: dict[str, list[list[float]]] = {"forward": [], "backward": []}
        for it in range(iters):
            for name in times:
                times[name].append([])
                energies[name].append([])
            for name, freq in sched.frequencies:
                t, e = table.lookup(stage, name, freq)
                if it < warmup:  # Warm-up iterations are off; the profiler must drop them.
                    t, e = 3 * t, 5 * e
                times[name][-1].append(t)
                energies[name][-1].append(e)
        out.append(
            ProfilingResult(
                rank=sched.rank,
                schedule_version=version,
                iter_time=[sum(sum(x) for x in (times[n][i] for n in times)) for i in range(iters)],
                iter_energy=[sum(sum(energies[n][i]) for n in energies) for i in range(iters)],
                time_breakdown=times,
                energy_breakdown=energies,
            )
        )
    return out


def drive(
    profiler: InstructionProfiler, job: JobInfo, table: InstructionTable, **kw
) -> tuple[list[list[FrequencySchedule]], list[list[ProfilingResult]]]:
    """Run the profiler to completion; return every version's schedules and results."""
    versions, observed = [], []
    for version in range(1, 500):
        schedules = profiler.next_schedule()
        versions.append(schedules)
        if profiler.done:
            return versions, observed
        results = fake_results(schedules, job, table, version=version, **kw)
        observed.append(results)
        profiler.observe(results)
    raise AssertionError("the profiler never finished")


def check_profile_matches(csv_path: Path, table: InstructionTable, job: JobInfo) -> None:
    """Every rank's row within TOL of the table, rows for both instructions of every rank."""
    profile = read_profile_csv(csv_path, num_stages=job.pp_degree)
    assert profile.full_form
    ranks_seen = set()
    for row in profile.rows:
        ranks_seen.add(row.rank)
        assert row.stage == row.rank % job.pp_degree
        t, e = table.expected(row.stage, row.instruction, row.frequency)
        where = f"rank {row.rank} {row.instruction} {row.frequency} MHz"
        assert row.time == pytest.approx(t, rel=TOL), where
        assert row.energy == pytest.approx(e, rel=TOL), where
    assert ranks_seen == set(range(job.world_size))
