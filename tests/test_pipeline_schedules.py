"""Pipeline schedules the planner supports (1F1B, GPipe): orders, DAG, plans, CLI, profiler."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from protocol.exceptions import ConfigError
from protocol.models import JobInfo, RankInfo
from protocol.pipeline_schedules import (
    PIPELINE_SCHEDULES,
    gpipe_order,
    one_f_one_b_order,
    schedules_matching,
    stage_actions,
    stage_order,
)
from schedulers.instruction_profiler import InstructionProfiler
from schedulers.planning.cli import optimize_command
from schedulers.planning.frontier_files import load_frontier
from schedulers.planning.pipeline_dag import PipelineShape
from schedulers.planning.plan_file import parse_plan_text, read_plan_file, write_plan_file
from schedulers.planning.planner import plan_frontier
from schedulers.planning.profile_csv import ProfileRow, build_profile
from schedulers.planning.synthetic_profile import synthetic_profile, write_synthetic_profile

F, B = "forward", "backward"
SHAPES = [(1, 1), (2, 2), (2, 5), (3, 2), (4, 4), (4, 8), (5, 3)]


def event_makespan(order: list[list[str]], durations: dict[tuple[int, str, int], float]) -> float:
    """Run each stage's list in order, waiting for its input; a check independent of the DAG."""
    stages = len(order)
    actions = [stage_actions_of(names) for names in order]  # Microbatches in order per kind.
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * stages
    pos = [0] * stages
    while any(pos[s] < len(actions[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            if pos[s] == len(actions[s]):
                continue
            name, m = actions[s][pos[s]]
            dep = (s - 1, F, m) if name == F else (s + 1, B, m)
            if 0 <= dep[0] < stages and dep not in done:
                continue
            start = max(free[s], done.get(dep, 0.0))
            done[(s, name, m)] = free[s] = start + durations[(s, name, m)]
            pos[s] += 1
            moved = True
        assert moved, "deadlock: the orders cannot run"
    return max(done.values())


def stage_actions_of(names: list[str]) -> list[tuple[str, int]]:
    seen = {F: 0, B: 0}
    out = []
    for name in names:
        out.append((name, seen[name]))
        seen[name] += 1
    return out


def test_gpipe_order_is_fill_then_drain() -> None:
    assert gpipe_order(4, 3, 0) == [F, F, F, B, B, B]
    assert gpipe_order(4, 3, 3) == [F, F, F, B, B, B]
    assert stage_order("gpipe", 2, 2, 1) == [F, F, B, B]
    assert stage_order("1f1b", 2, 2, 1) == one_f_one_b_order(2, 2, 1) == [F, B, F, B]


def test_actions_number_microbatches_in_order() -> None:
    assert stage_actions("1f1b", 4, 4, 1) == [
        (F, 0), (F, 1), (F, 2), (B, 0), (F, 3), (B, 1), (B, 2), (B, 3)
    ]  # fmt: skip
    assert stage_actions("gpipe", 2, 2, 0) == [(F, 0), (F, 1), (B, 0), (B, 1)]


@pytest.mark.parametrize("bad", ["interleaved", "1F1B", ""])
def test_unsupported_schedule_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="unsupported pipeline schedule"):
        stage_order(bad, 2, 2, 0)
    with pytest.raises(ConfigError, match="unsupported pipeline schedule"):
        PipelineShape(2, 2, bad)


def test_schedules_matching_tells_the_orders_apart() -> None:
    for schedule in PIPELINE_SCHEDULES:
        orders = [stage_order(schedule, 4, 6, s) for s in range(4)]
        assert schedules_matching(orders) == [schedule]
    # One microbatch: both schedules run forward then backward.
    assert schedules_matching([[F, B], [F, B]]) == list(PIPELINE_SCHEDULES)
    assert schedules_matching([[B, F]]) == []
    # A subset of stages, matched against the whole pipeline's orders.
    assert schedules_matching([one_f_one_b_order(4, 6, 0)], num_stages=4) == ["1f1b"]


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
@pytest.mark.parametrize(("stages", "micro"), SHAPES)
def test_dag_makespan_equals_an_event_simulation(schedule: str, stages: int, micro: int) -> None:
    shape = PipelineShape(stages, micro, schedule)
    rng = random.Random(stages * 100 + micro)
    durations = [rng.uniform(0.5, 3.0) for _ in shape.nodes]
    by_key = dict(zip(shape.nodes, durations, strict=True))
    assert shape.makespan(durations) == pytest.approx(event_makespan(shape.order, by_key))


def test_gpipe_and_1f1b_differ_only_in_order() -> None:
    one, gp = PipelineShape(3, 4, "1f1b"), PipelineShape(3, 4, "gpipe")
    assert sorted(one.nodes) == sorted(gp.nodes)
    cross = {
        (a, b)
        for shape in (one, gp)
        for a, b in ((shape.nodes[p], shape.nodes[i]) for p, i in shape.edges())
        if a[0] != b[0]
    }
    # Cross-stage edges are the data dependencies, the same for both schedules.
    assert all(
        (b[1] == F and b[0] == a[0] + 1) or (b[1] == B and b[0] == a[0] - 1) for a, b in cross
    )
    # Uniform unit times: both take (M + S - 1) forward and backward slots.
    assert one.makespan([1.0] * one.num_nodes) == gp.makespan([1.0] * gp.num_nodes) == 12.0


# --- planner --------------------------------------------------------------------------------
U = 0.01
EXACT = {  # (stage, instruction) -> quantized times; energy falls exponentially with time.
    (0, F): (range(10, 13), 30.0, -0.25),
    (0, B): (range(20, 22), 60.0, -0.15),
    (1, F): (range(14, 17), 40.0, -0.2),
    (1, B): (range(28, 30), 80.0, -0.1),
}


def test_gpipe_frontier_matches_brute_force(tmp_path: Path) -> None:
    clocks = [1980, 1800, 1600]
    rows = [
        ProfileRow(s, inst, clocks[k], (q + 0.5) * U, a * math.exp(b * q))
        for (s, inst), (qs, a, b) in EXACT.items()
        for k, q in enumerate(qs)
    ]
    profile = build_profile(rows)
    result = plan_frontier(profile, 2, 2, out_dir=tmp_path, unit_time=U, schedule="gpipe")
    shape = PipelineShape(2, 2, "gpipe")
    options = [
        [(int(t // U), e) for t, e in profile.table[(s, i)].values()] for s, i, _ in shape.nodes
    ]
    best: dict[int, float] = {}
    for combo in itertools.product(*options):
        quantized = dict(zip(shape.nodes, [q for q, _ in combo], strict=True))
        t = int(event_makespan(shape.order, quantized))
        best[t] = min(best.get(t, math.inf), sum(e for _, e in combo))
    for point in result.points:
        least = min(e for t, e in best.items() if t <= point.quant_time)
        assert point.energy == pytest.approx(least, rel=1e-9)
    assert result.points[-1].quant_time == min(best)
    assert result.meta["pipeline_schedule"] == "gpipe"
    plan = read_plan_file(tmp_path / result.points[0].file)
    assert plan.header["pipeline_schedule"] == "gpipe" and plan.schedule == "gpipe"
    assert [[n for n, _ in stage] for stage in plan.stages] == shape.order


def test_optimize_cli_takes_the_schedule(tmp_path: Path) -> None:
    csv = tmp_path / "profile.csv"
    write_synthetic_profile(csv, 3, stride=16)
    out = tmp_path / "out"
    args = [str(csv), "-s", "3", "-m", "4", "--out", str(out), "--no-plot", "--schedule", "gpipe"]
    run = CliRunner().invoke(optimize_command, args)
    assert run.exit_code == 0, run.output
    frontier = load_frontier(out)
    assert frontier.meta["pipeline_schedule"] == "gpipe"
    plan = read_plan_file(out / frontier.points[-1].file)
    assert [[n for n, _ in s] for s in plan.stages] == [gpipe_order(3, 4, s) for s in range(3)]
    bad = CliRunner().invoke(optimize_command, [*args[:-1], "interleaved"])
    assert bad.exit_code != 0 and "'interleaved' is not one of '1f1b', 'gpipe'" in bad.output


# --- plan files -----------------------------------------------------------------------------
def test_plan_header_schedule_must_match_the_order(tmp_path: Path) -> None:
    stages = [[(n, 1980) for n in one_f_one_b_order(2, 3, s)] for s in range(2)]
    path = tmp_path / "plan.py"
    write_plan_file(path, stages, {"pipeline_schedule": "1f1b"})
    assert read_plan_file(path).schedule == "1f1b"
    text = path.read_text().replace("pipeline_schedule: 1f1b", "pipeline_schedule: gpipe")
    err = r"<p>:\d+: stage 0: item 2 is 'backward' but .* gpipe runs 'forward' there \(it follows"
    with pytest.raises(ConfigError, match=err):
        parse_plan_text(text, source="<p>")
    text = path.read_text().replace("pipeline_schedule: 1f1b", "pipeline_schedule: zb")
    with pytest.raises(ConfigError, match="'pipeline_schedule' names unsupported schedule 'zb'"):
        parse_plan_text(text, source="<p>")


def test_frequency_only_plan_follows_the_header_schedule() -> None:
    plan = parse_plan_text("# pipeline_schedule: gpipe\n[[1, 2, 3, 4], [5, 6, 7, 8]]")
    assert plan.stages[1] == [(F, 5), (F, 6), (B, 7), (B, 8)]
    assert parse_plan_text("[[1, 2, 3, 4], [5, 6, 7, 8]]").stages[1] == [
        (F, 5), (B, 6), (F, 7), (B, 8)
    ]  # fmt: skip


def test_plan_without_header_reports_the_schedule_its_order_follows() -> None:
    gpipe = [[(n, 1980) for n in gpipe_order(3, 4, s)] for s in range(3)]
    text = "[" + ",".join(repr(stage) for stage in gpipe) + "]"
    assert parse_plan_text(text).schedule == "gpipe"


# --- profiler -------------------------------------------------------------------------------
def test_instruction_profiler_sweeps_in_the_schedule_order() -> None:
    job = JobInfo(pp_degree=3, dp_degree=1, tp_degree=1, world_size=3, job_id="j")
    ranks = [
        RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=[1980, 1500])
        for r in range(3)
    ]
    profiler = InstructionProfiler(job, ranks, microbatches=4, schedule="gpipe")
    first = profiler.next_schedule()
    for sched in first:
        assert [n for n, _ in sched.frequencies] == gpipe_order(3, 4, sched.rank)
    with pytest.raises(ConfigError, match="unsupported pipeline schedule 'zb'"):
        InstructionProfiler(job, ranks, microbatches=4, schedule="zb")


def test_synthetic_profile_plans_for_both_schedules(tmp_path: Path) -> None:
    # GPipe keeps every activation; on equal instruction times its iteration is as long as 1F1B's.
    profile = synthetic_profile(2, stride=30)
    times = {
        s: plan_frontier(profile, 2, 4, out_dir=tmp_path / s, schedule=s).allmax.iteration_time
        for s in PIPELINE_SCHEDULES
    }
    assert times["gpipe"] == pytest.approx(times["1f1b"])
