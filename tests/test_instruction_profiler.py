"""InstructionProfiler (in process and through a real coordinator) and simulated training.

In process, the profiler is fed ProfilingResults computed from an InstructionTable, as the
hook would report them; the multi-process tests run real `perseus coordinator` and
`perseus worker` processes and spawned simulated ranks (gloo, simulated GPUs and clocks).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from protocol.exceptions import ConfigError, ProtocolError
from protocol.models import JobInfo
from schedulers.instruction_profiler import InstructionProfiler
from schedulers.planning.pipeline_dag import PipelineShape, one_f_one_b_order
from schedulers.planning.plan_file import read_plan_file, write_plan_file
from schedulers.planning.profile_csv import read_profile_csv
from schedulers.profile_then import PLAN_MARKER
from tests.helpers import start_perseus, stop
from tests.profiler_jobs import PROFILER, check_profile_matches, drive, fake_results, make_job
from worker_client.simulated.gpu import (
    GRAPHICS_CLOCKS,
    InstructionTable,
    synthetic_instruction_table,
)
from worker_client.simulated.training import launch_simulated_job


def first_stop(energies: list[float], rises: int = 5) -> int:
    """Number of measurements until energy rose ``rises`` times in a row (or all of them)."""
    run = 0
    for i in range(1, len(energies)):
        run = run + 1 if energies[i] > energies[i - 1] else 0
        if run == rises:
            return i + 1
    return len(energies)


# --- in process -------------------------------------------------------------------------------
def test_sweep_recovers_the_table_and_stops_after_five_rises(tmp_path):
    job, ranks = make_job(pp=2, dp=2)
    table = synthetic_instruction_table(2, noise=0.005, seed=3)
    out = tmp_path / "profile.csv"
    profiler = InstructionProfiler(job, ranks, out_path=str(out), microbatches=2)
    versions, _ = drive(profiler, job, table)

    check_profile_matches(out, table, job)
    for (stage, inst), sweep in profiler.sweeps.items():
        assert sweep.stopped
        # Stage energies are what the rule saw: it stopped at the first run of five rises.
        assert len(sweep.measured) == first_stop(sweep.energies)
        assert sweep.rises == 5, (stage, inst)  # This table's energy rises at low clocks.
        assert sweep.measured == list(GRAPHICS_CLOCKS[: len(sweep.measured)])
    # Version 1 is all-max; the last version serves all-max again.
    for schedules in (versions[0], versions[-1]):
        assert all(f == 1980 for s in schedules for _, f in s.frequencies)
    longest = max(len(s.measured) for s in profiler.sweeps.values())
    assert len(versions) == longest + 1
    # Serving the final schedule does not look at results any more.
    profiler.observe([])
    assert profiler.next_schedule() == versions[-1]


def pattern_table(noise: float = 0.003) -> tuple[InstructionTable, list[int], dict]:
    """A table with known stopping points on 20 clocks (energy steps of >= 3%)."""
    clocks = list(GRAPHICS_CLOCKS[:20])
    f0 = [1.0 - 0.05 * i for i in range(5)] + [0.8 + 0.05 * i for i in range(1, 16)]
    b0 = [10, 9, 8, 8.5, 9, 9.5, 9.2, 9.6, 10, 10.4, 10.8, 11.2] + [12 + i for i in range(8)]
    f1 = [2.0 - 0.05 * i for i in range(20)]
    b1 = [5.0 + 0.5 * i for i in range(20)]
    rows = []
    for (stage, inst), energies in {
        (0, "forward"): f0,
        (0, "backward"): b0,
        (1, "forward"): f1,
        (1, "backward"): b1,
    }.items():
        for f, e in zip(clocks, energies, strict=True):
            rows.append((stage, inst, f, 0.01 * (stage + 1) * 1980 / f, float(e)))
    # Rises 5-9 -> 10 measured; rises 3-5, fall, rises 7-11 -> 12; never -> all 20; 1-5 -> 6.
    stops = {(0, "forward"): 10, (0, "backward"): 12, (1, "forward"): 20, (1, "backward"): 6}
    return InstructionTable(rows, noise=noise, seed=7), clocks, stops


def test_each_sweep_stops_exactly_after_the_fifth_consecutive_rise(tmp_path):
    job, ranks = make_job(pp=2, dp=1)
    table, clocks, stops = pattern_table()
    out = tmp_path / "profile.csv"
    profiler = InstructionProfiler(
        job, ranks, out_path=str(out), microbatches=3, frequencies=clocks
    )
    versions, _ = drive(profiler, job, table, iters=2)

    for key, n in stops.items():
        assert profiler.sweeps[key].measured == clocks[:n], key
    assert len(versions) == 20 + 1
    # Version 11: stage 0 forward has stopped (max clock); its backward measures clock 10.
    got = {name: f for name, f in versions[10][0].frequencies}
    assert got == {"forward": 1980, "backward": clocks[10]}
    check_profile_matches(out, table, job)
    profile = read_profile_csv(out)
    for (stage, inst), n in stops.items():
        assert profile.frequencies(stage, inst) == clocks[:n]


def test_missing_energy_breakdown_is_a_clear_error(tmp_path):
    job, ranks = make_job(pp=2, dp=1)
    profiler = InstructionProfiler(job, ranks, out_path=str(tmp_path / "p.csv"), microbatches=2)
    schedules = profiler.next_schedule()
    results = fake_results(schedules, job, synthetic_instruction_table(2))
    profiler.observe([r.model_copy(update={"energy_breakdown": {}}) for r in results])
    with pytest.raises(ProtocolError, match="instruction_energy=True"):
        profiler.next_schedule()


def test_a_result_without_an_instruction_is_refused_before_it_is_stored(tmp_path):
    """check_result runs at the coordinator: refused there, it fails no job."""
    job, ranks = make_job(pp=1, dp=1)
    profiler = InstructionProfiler(job, ranks, out_path=str(tmp_path / "p.csv"), microbatches=2)
    [good] = fake_results(profiler.next_schedule(), job, synthetic_instruction_table(1))
    InstructionProfiler.check_result(good)
    for name in ("forward", "backward"):
        times = {k: v for k, v in good.time_breakdown.items() if k != name}
        energies = {k: v for k, v in good.energy_breakdown.items() if k != name}
        bad = good.model_copy(update={"time_breakdown": times, "energy_breakdown": energies})
        with pytest.raises(ProtocolError, match=f"no '{name}' times in the result"):
            InstructionProfiler.check_result(bad)


def test_a_stage_without_a_common_clock_names_its_ranks(tmp_path):
    """The same check, and message, as a 3D-parallel wrapper's (schedulers.parallel3d)."""
    job, ranks = make_job(pp=2, dp=2)
    ranks[3] = ranks[3].model_copy(update={"available_frequencies": [300]})  # below every clock
    with pytest.raises(
        ConfigError, match=r"^job job: the ranks of stage 1 \(\[1, 3\]\) have no GPU frequency in"
    ):
        InstructionProfiler(job, ranks, out_path=str(tmp_path / "p.csv"), microbatches=2)


def test_results_that_are_all_warmup_are_refused(tmp_path):
    job, ranks = make_job(pp=1, dp=1)
    profiler = InstructionProfiler(job, ranks, out_path=str(tmp_path / "p.csv"), microbatches=2)
    schedules = profiler.next_schedule()
    profiler.observe(fake_results(schedules, job, synthetic_instruction_table(1), iters=1))
    with pytest.raises(ProtocolError, match="report_every"):
        profiler.next_schedule()


def test_bad_arguments(tmp_path):
    job, ranks = make_job(pp=2, dp=1)
    out = str(tmp_path / "p.csv")
    with pytest.raises(ConfigError, match=r"\[1234\] MHz are not supported"):
        InstructionProfiler(job, ranks, out_path=out, microbatches=2, frequencies=[1980, 1234])
    with pytest.raises(ConfigError, match="out_dir"):
        InstructionProfiler(job, ranks, out_path=out, microbatches=2, then={"p2p_power": 1.0})
    with pytest.raises(ConfigError, match="unknown key"):
        InstructionProfiler(
            job, ranks, out_path=out, microbatches=2, then={"out_dir": "x", "bogus": 1}
        )
    with pytest.raises(ConfigError, match="unknown policy"):
        InstructionProfiler(
            job, ranks, out_path=out, microbatches=2, then={"out_dir": "x", "policy": "?"}
        )


# --- multi-process ---------------------------------------------------------------------------
@pytest.fixture
def start_services(tmp_path, redis_url, monkeypatch):
    """Start `perseus coordinator` (with a scheduler) and `perseus worker` as processes."""
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "simgpu"))  # Spawned ranks too.
    procs: list[subprocess.Popen] = []

    def start(scheduler: str, args: dict) -> None:
        for name, cmd in (
            ("coordinator", ["--scheduler", scheduler, "--scheduler-args", json.dumps(args)]),
            ("worker", ["--simple"]),
        ):
            procs.append(
                start_perseus([name, "--redis-url", redis_url, *cmd], tmp_path, f"{name}.log")
            )

    yield start
    stop(procs)


def test_profile_optimize_serve_through_coordinator(start_services, tmp_path, redis_url):
    from schedulers.planning.choose import choose_plan

    started = time.monotonic()
    table = synthetic_instruction_table(2, noise=0.002, seed=2)
    clocks = [1980, 1800, 1500, 1200, 900, 600]
    out, plans = tmp_path / "profile.csv", tmp_path / "plans"
    then = {"out_dir": str(plans), "p2p_power": table.blocking_power_w, "unit_time": 0.001}
    start_services(
        PROFILER,
        {"out_path": str(out), "microbatches": 2, "frequencies": clocks, "then": then},
    )
    records = launch_simulated_job(
        2,
        2,
        1,
        table,
        redis_url,
        steps=300,
        report_every=3,
        time_scale=0.05,
        # The marker is written once the planner is done, just before the plan is published.
        stop_file=str(plans / "*" / PLAN_MARKER),  # the job's folder: its id is not known yet
        steps_after_stop=40,
        timeout=120,
    )
    assert out.is_file(), (tmp_path / "worker.log").read_text()[-3000:]
    job = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    check_profile_matches(out, table, job)
    profile = read_profile_csv(out)
    for stage in (0, 1):
        for inst in ("forward", "backward"):
            assert profile.frequencies(stage, inst) == clocks  # No 5 rises in 6 clocks.
    [folder] = [p.parent for p in plans.glob(f"*/{PLAN_MARKER}")]  # the job's own
    plan = read_plan_file(choose_plan(folder, "no-slowdown").file)
    for rec in records:
        # Version k swept clock k-1; each ran >= report_every steps before the next arrived.
        seen = sorted({int(v) for v in rec["version"]})
        assert seen[: len(clocks)] == list(range(1, len(clocks) + 1))
        for k in range(1, len(clocks) + 1):
            assert {f for _, f in rec["schedules"][str(k)]} == {clocks[k - 1]}
            assert rec["version"].count(k) >= 3
        # Then the planned version: the plan chosen from the frontier, this rank's stage line.
        final = rec["schedules"][str(rec["final_version"])]
        assert rec["final_version"] > len(clocks)
        assert [tuple(pair) for pair in final] == plan.stages[rec["pp_rank"]]
    assert time.monotonic() - started < 60


def allmax_plan(path: Path, stages: int, microbatches: int) -> None:
    lines = [[(n, 1980) for n in one_f_one_b_order(stages, microbatches, s)] for s in range(stages)]
    write_plan_file(path, lines, {"plan": 0})


def table_figures(table: InstructionTable, stages: int, microbatches: int) -> tuple[float, list]:
    """All-max 1F1B critical path and each stage's compute (time, energy) from the table."""
    shape = PipelineShape(stages, microbatches)
    makespan = shape.makespan([table[(s, i, 1980)][0] for s, i, _ in shape.nodes])
    compute = [
        (
            sum(table[(s, n, 1980)][0] for n in shape.order[s]),
            sum(table[(s, n, 1980)][1] for n in shape.order[s]),
        )
        for s in range(stages)
    ]
    return makespan, compute


def test_simulated_training_follows_the_1f1b_critical_path(start_services, tmp_path, redis_url):
    stages, microbatches = 2, 3
    table = synthetic_instruction_table(stages, imbalance=[1.0, 1.6], blocking_power_w=90.0)
    allmax_plan(tmp_path / "plan.py", stages, microbatches)
    start_services("PointSolution3D", {"solution_path": str(tmp_path / "plan.py")})
    records = launch_simulated_job(
        stages, microbatches, 2, table, redis_url, steps=4, report_every=2, time_scale=0.02
    )
    makespan, compute = table_figures(table, stages, microbatches)
    # The bubble is real: the iteration is longer than the busiest stage's own work.
    assert makespan > max(t for t, _ in compute) * 1.1
    assert len(records) == 4
    for rec in records:
        t_stage, e_stage = compute[rec["pp_rank"]]
        for it, energy, idle in zip(
            rec["iter_time"], rec["iter_energy"], rec["idle_energy"], strict=True
        ):
            assert it == pytest.approx(makespan, rel=1e-9)
            assert idle == pytest.approx(90.0 * (makespan - t_stage), rel=1e-9)
            # Compute plus blocking energy (the counter keeps whole millijoules).
            assert energy == pytest.approx(e_stage + idle, abs=2e-3)
        assert rec["compute_time"][0] == pytest.approx(t_stage)
        assert rec["reports_sent"] >= 1


def test_simulated_training_wall_clock_waits_for_the_slow_stage(
    start_services, tmp_path, redis_url
):
    stages, microbatches = 2, 2
    table = synthetic_instruction_table(stages, base_forward_time=0.08, imbalance=[1.0, 1.5])
    allmax_plan(tmp_path / "plan.py", stages, microbatches)
    start_services("PointSolution3D", {"solution_path": str(tmp_path / "plan.py")})
    records = launch_simulated_job(
        stages, microbatches, 1, table, redis_url, steps=3, time_scale=1.0, timing="wall"
    )
    makespan, compute = table_figures(table, stages, microbatches)
    for rec in records:
        measured = statistics.median(rec["iter_time"])
        # Real sleeping and real waits on gloo messages: wall time tracks the critical path
        # (0.96 s), plus per-instruction overhead that a loaded 2-core machine stretches to
        # ~50 ms (1.01-1.02 s seen there): far from the busiest stage's own work (0.72 s) and
        # from all stages' work in series (1.2 s), and well above stage 0's own.
        assert makespan * 0.97 <= measured <= makespan * 1.12
        assert measured < compute[0][0] + compute[1][0]
        assert measured > compute[0][0] * 1.5


def test_a_5000_rank_job_missing_results_names_a_few_ranks() -> None:
    job, ranks = make_job(pp=1, dp=5_000)
    profiler = InstructionProfiler(job, ranks, microbatches=1, frequencies=[1980])
    first = profiler.next_schedule()
    profiler.observe(fake_results(first[:1], job, synthetic_instruction_table(1), version=1))
    with pytest.raises(ProtocolError) as info:
        profiler.next_schedule()  # The sweep takes the results in.
    assert str(info.value) == (
        "no profiling results from ranks [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ... and 4,989 more "
        "(4,999 in all)]"
    )
    state = profiler.snapshot()
    state["rank_data"] = state["rank_data"][:1]
    with pytest.raises(ValueError, match=r"snapshot has ranks \[0\], expected \[0, 1, .*\(5,000"):
        InstructionProfiler(job, ranks, microbatches=1, frequencies=[1980]).restore(state)
