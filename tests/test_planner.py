"""Planner: optimality against brute force, frontier shape, plan files, policies, scheduler.

Optimality is checked two ways on pipelines small enough to enumerate every assignment of a
clock to each instruction instance (each assignment's iteration time is the 1F1B DAG's longest
path over the same rounded-down, quantized times the solver uses):

* Exact profiles: every candidate time is a distinct whole number of units, one after the
  other, and energies lie exactly on the solver's cost model (an exponential, or straight lines
  for three or fewer points). Then every duration the solver can pick is a real clock, and each
  frontier point must *equal* the brute-force least energy among assignments at least as fast.
* A synthetic profile with coarse clocks: the solver optimises its fitted models over
  continuous durations, so a point's model cost must not exceed the least model cost of any
  discrete assignment at least as fast. Real energies are not compared here: the fit and the
  rounding of durations to actual clocks can cost a few percent (measured: up to ~4% with
  clocks 300 MHz apart), which is the model's approximation, not a solver error.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from protocol.exceptions import ConfigError
from protocol.models import JobInfo, RankInfo
from schedulers.planning.choose import choose_plan, parse_policy
from schedulers.planning.frontier_files import load_frontier
from schedulers.planning.pipeline_dag import PipelineShape, one_f_one_b_order
from schedulers.planning.plan_file import read_plan_file
from schedulers.planning.planner import InterpolatedCostModel, pareto_frequencies, plan_frontier
from schedulers.planning.profile_csv import ProfileRow, build_profile, read_profile_csv
from schedulers.planning.synthetic_profile import (
    synthetic_profile,
    synthetic_rows,
    write_synthetic_profile,
)
from worker_client.simulated.gpu import GRAPHICS_CLOCKS, synthetic_instruction_table

CLOCKS = [1980, 1800, 1600, 1400]
U = 0.01  # Unit time of the exact profiles.

# (stage, instruction) -> (quantized times, a, b, c): energy = a * exp(b * q) + c.
EXACT_2X2 = {
    (0, "forward"): (range(10, 14), 30.0, -0.25, 2.0),
    (0, "backward"): (range(20, 23), 60.0, -0.15, 4.0),
    (1, "forward"): (range(14, 18), 40.0, -0.2, 3.0),
    (1, "backward"): (range(28, 31), 80.0, -0.1, 5.0),
}


def exact_profile(spec: dict) -> object:
    rows = []
    for (stage, inst), (qs, a, b, c) in spec.items():
        for k, q in enumerate(qs):
            # Mid-unit times so that rounding down gives q whatever the float error.
            rows.append(ProfileRow(stage, inst, CLOCKS[k], (q + 0.5) * U, a * math.exp(b * q) + c))
    return build_profile(rows)


def brute_force(shape: PipelineShape, options: dict) -> dict[int, float]:
    """Least total cost per quantized iteration time over all assignments."""
    per_node = [options[(s, i)] for s, i, _ in shape.nodes]
    best: dict[int, float] = {}
    for combo in itertools.product(*per_node):
        t = int(shape.makespan([q for q, _ in combo]))
        e = sum(c for _, c in combo)
        if e < best.get(t, math.inf):
            best[t] = e
    return best


def best_within(best: dict[int, float], limit: int) -> float:
    return min(e for t, e in best.items() if t <= limit)


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory: pytest.TempPathFactory):
    prof = exact_profile(EXACT_2X2)
    out = tmp_path_factory.mktemp("exact")
    return prof, plan_frontier(prof, 2, 2, out_dir=out, unit_time=U)


@pytest.fixture(scope="module")
def synth_run(tmp_path_factory: pytest.TempPathFactory):
    prof = synthetic_profile(2, stride=20)  # Four Pareto clocks per instruction.
    out = tmp_path_factory.mktemp("synth")
    return prof, plan_frontier(prof, 2, 2, out_dir=out, unit_time=0.001)


def test_exact_frontier_matches_brute_force(exact_run) -> None:
    prof, result = exact_run
    shape = PipelineShape(2, 2)
    options = {key: [(int(t // U), e) for t, e in prof.table[key].values()] for key in prof.table}
    best = brute_force(shape, options)
    assert len(result.points) == max(best) - min(best) + 1  # One point per time unit.
    for p in result.points:
        assert p.energy == pytest.approx(best_within(best, p.quant_time), rel=1e-9, abs=1e-9)
        assert p.model_cost == pytest.approx(p.energy, rel=1e-6)
    assert result.points[0].quant_time == max(best)
    assert result.points[-1].quant_time == min(best)


def test_more_stages_than_microbatches_matches_brute_force(tmp_path: Path) -> None:
    spec = {
        (0, "forward"): (range(10, 12), 20.0, -0.3, 1.0),
        (0, "backward"): (range(18, 20), 30.0, -0.2, 2.0),
        (1, "forward"): (range(13, 15), 25.0, -0.3, 1.0),
        (1, "backward"): (range(25, 27), 40.0, -0.2, 2.0),
        (2, "forward"): (range(8, 10), 15.0, -0.3, 1.0),
        (2, "backward"): (range(16, 18), 20.0, -0.2, 2.0),
    }
    prof = exact_profile(spec)
    result = plan_frontier(prof, 3, 2, out_dir=tmp_path, unit_time=U)
    options = {k: [(int(t // U), e) for t, e in prof.table[k].values()] for k in prof.table}
    best = brute_force(PipelineShape(3, 2), options)
    for p in result.points:
        assert p.energy == pytest.approx(best_within(best, p.quant_time), rel=1e-9)
    assert {f["model"] for f in result.meta["fits"].values()} == {"interpolated"}


def test_model_cost_is_optimal_on_synthetic_profile(synth_run) -> None:
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption

    prof, result = synth_run
    unit = result.meta["unit_time"]
    options = {}
    for (stage, inst), tab in prof.table.items():
        cands = CandidateExecutionOptions(
            options=[
                ExecutionOption(real_time=tab[f][0], unit_time=unit, cost=tab[f][1], knob=f)
                for f in pareto_frequencies(tab)
            ]
        )
        fit = result.meta["fits"][f"{stage}/{inst}"]
        if fit["model"] == "exponential":
            a, b, c = fit["coefficients"]

            def model(q: int, a: float = a, b: float = b, c: float = c) -> float:
                return a * math.exp(b * q) + c
        else:
            model = InterpolatedCostModel([(o.quant_time, o.cost) for o in cands.options])
        options[(stage, inst)] = [(o.quant_time, model(o.quant_time)) for o in cands.options]
    assert "exponential" in {f["model"] for f in result.meta["fits"].values()}
    best = brute_force(PipelineShape(2, 2), options)
    for p in result.points:
        assert p.model_cost <= best_within(best, p.quant_time) + 1e-6


def test_frontier_is_monotone_and_fastest_matches_allmax(exact_run, synth_run) -> None:
    for _, result in (exact_run, synth_run):
        pts = result.points
        assert [p.plan for p in pts] == [f"{i:05d}" for i in range(len(pts))]
        for slower, faster in itertools.pairwise(pts):
            assert faster.quant_time < slower.quant_time  # Larger number: shorter.
            assert faster.model_cost >= slower.model_cost - 1e-9
        bound = result.rounding_bound
        unit = result.meta["unit_time"]
        assert bound == result.meta["max_path_instructions"] * unit
        assert abs(pts[-1].iteration_time - result.allmax.iteration_time) <= bound
        assert pts[-1].energy < result.allmax.energy  # Free savings at no slowdown.
        # The solver's quantized time can exceed the real one (its durations may fall between
        # clocks, and each runs at the slowest clock that fits) but undershoots it by < bound.
        for p in [*pts, result.allmax]:
            assert p.iteration_time - p.quant_time * unit < bound
        assert result.allmax.quant_time * unit <= result.allmax.iteration_time
    _, exact = exact_run
    for slower, faster in itertools.pairwise(exact.points):
        assert faster.energy >= slower.energy - 1e-9


def test_dag_matches_lowtime_dependency_rules() -> None:
    from lowtime.graph_utils import DependencyResolver
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
    from lowtime.perseus.instruction import Instruction, backward_dep, forward_dep

    from schedulers.planning.pipeline_dag import build_lowtime_dag

    prof = synthetic_profile(4, stride=40)

    specs = {}
    for key, tab in prof.table.items():
        cands = CandidateExecutionOptions(
            options=[
                ExecutionOption(real_time=t, unit_time=0.001, cost=e, knob=f)
                for f, (t, e) in tab.items()
            ]
        )
        specs[key] = OperationSpec(options=cands, cost_model=InterpolatedCostModel([(1, 1.0)]))
    for stages, micro in [(4, 6), (4, 2), (3, 3)]:
        shape = PipelineShape(stages, micro)
        graph, ops = build_lowtime_dag(shape, specs)
        resolver = DependencyResolver([forward_dep, backward_dep], Instruction)
        expected = set()
        for s in range(stages):  # A stage runs its instructions one after another.
            expected |= {(shape.node(s, k), shape.node(s, k + 1)) for k in range(2 * micro - 1)}
        for a, b in itertools.product(range(len(ops)), repeat=2):  # lowtime's O(n^2) way.
            if resolver.is_dependent(ops[a], ops[b]):
                expected.add((a, b))
        got = {(u, v) for u, v in graph.edges if u < len(ops) and v < len(ops)}
        assert got == expected
        assert [type(o).__name__.lower() for o in ops[: 2 * micro]] == one_f_one_b_order(
            stages, micro, 0
        )
        assert set(graph.successors(graph.graph["source_node"])) == {shape.node(0, 0)}


def test_synthetic_profile_is_the_simulated_gpu_model(tmp_path: Path) -> None:
    for stages, stride in [(1, 1), (2, 4), (4, 20)]:
        rows = synthetic_rows(stages, stride=stride)
        table = synthetic_instruction_table(stages, GRAPHICS_CLOCKS[::stride])
        assert {(r.stage, r.instruction, r.frequency): (r.time, r.energy) for r in rows} == dict(
            table
        )
        # Forward first, then backward; clocks high to low, the highest always kept.
        first = [r.frequency for r in rows if (r.stage, r.instruction) == (0, "forward")]
        assert first == sorted(first, reverse=True) and first[0] == max(GRAPHICS_CLOCKS)
        order = ["forward"] * len(first) + ["backward"] * len(first)
        assert [r.instruction for r in rows[: len(order)]] == order
    # The model's jitter is seeded the same way on both sides (CSV floats round-trip exactly).
    path = write_synthetic_profile(tmp_path / "p.csv", 2, stride=8, jitter=0.02, seed=3)
    jittered = synthetic_instruction_table(2, GRAPHICS_CLOCKS[::8], jitter=0.02, seed=3)
    from_csv = {
        (stage, inst, freq): te
        for (stage, inst), by_freq in read_profile_csv(path).table.items()
        for freq, te in by_freq.items()
    }
    assert from_csv == dict(jittered)


def test_pareto_filter() -> None:
    entry = {
        1980: (1.0, 10.0),
        1800: (1.1, 9.0),
        1700: (1.1, 9.5),
        1600: (1.3, 9.0),
        1500: (1.5, 9.5),
        1400: (1.6, 8.0),
        1300: (1.6, 8.0),
    }
    assert pareto_frequencies(entry) == [1980, 1800, 1400]
    # With P2P power, slower clocks get cheaper: 1600 now beats 1800 (9 - 1.3 < 9 - 1.1).
    assert pareto_frequencies(entry, p2p_power=5.0) == [1980, 1800, 1600, 1500, 1400]


def test_plan_files_round_trip_and_serve(exact_run) -> None:
    from schedulers.point_solution import PointSolution

    prof, result = exact_run
    point = result.points[len(result.points) // 2]
    plan = read_plan_file(result.out_dir / point.file)
    assert plan.header["plan"] == point.plan
    assert plan.header_float("iteration_time") == point.iteration_time
    assert plan.header_float("energy") == point.energy
    assert plan.header_float("energy_with_p2p") == point.energy_with_p2p
    assert plan.header_float("unit_time") == U
    for s, stage in enumerate(plan.stages):
        assert [n for n, _ in stage] == one_f_one_b_order(2, 2, s)
        assert all(f in prof.table[(s, n)] for n, f in stage)
    job = JobInfo(job_id="j", pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
    ranks = [
        RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=CLOCKS)
        for r in range(2)
    ]
    sched = PointSolution(job, ranks, solution_path=str(result.out_dir / point.file))
    by_rank = {s.rank: s.frequencies for s in sched.next_schedule()}
    assert by_rank == {0: plan.stages[0], 1: plan.stages[1]}
    # The folder's profile.csv is the averaged profile the plans came from.
    assert read_profile_csv(result.out_dir / "profile.csv", num_stages=2).table == prof.table


def _write_frontier(out: Path, rows: list[tuple], bound: float = 0.004) -> Path:
    import json

    out.mkdir(parents=True, exist_ok=True)
    head = "plan,iteration_time,energy,energy_with_p2p,quant_time,model_cost,dominated,file"
    lines = {"frontier.csv": [head], "allmax.csv": [head]}
    for plan, t, e, *flag in rows:
        name = "" if plan == "allmax" else f"freqs_pipeline_{int(plan):05d}.py"
        dominated = int(bool(flag and flag[0]))
        row = f"{plan},{t},{e},{e},{round(t * 1000)},{'' if not name else e},{dominated},{name}"
        lines["allmax.csv" if plan == "allmax" else "frontier.csv"].append(row)
    for file, text in lines.items():
        (out / file).write_text("\n".join(text) + "\n")
    (out / "frontier.json").write_text(json.dumps({"rounding_bound": bound}))
    return out


def test_choose_policies(tmp_path: Path) -> None:
    # Fastest plan 2 ms above all-max (rounding), within the 4 ms bound.
    out = _write_frontier(
        tmp_path / "f",
        [
            ("0", 1.5, 60.0),
            ("1", 1.2, 70.0),
            ("2", 1.1, 76.0),
            ("3", 1.002, 90.0),
            ("allmax", 1.0, 100.0),
        ],
    )
    c = choose_plan(out, "no-slowdown")
    assert (c.plan, c.iteration_time, c.saving_j) == ("00003", 1.002, 10.0)
    assert c.saving_pct == pytest.approx(10.0) and c.slowdown_pct == pytest.approx(0.2)
    assert "rounding" in c.note and c.file == out / "freqs_pipeline_00003.py"
    assert choose_plan(out, "min-energy").plan == "00000"
    assert choose_plan(out, "max-slowdown", 1.1).plan == "00002"
    assert choose_plan(out, "max-slowdown 1.25").plan == "00001"
    assert choose_plan(out, "max-slowdown=1.0").plan == "00003"
    assert choose_plan(out, "deadline", 1.3).plan == "00001"
    assert choose_plan(out, "straggler", 9.0).plan == "00000"  # Slower than every plan.
    fast = choose_plan(out, "straggler", 0.5)  # Faster than every plan: the fastest.
    assert fast.plan == "00003" and "faster than every plan" in fast.note
    with pytest.raises(ConfigError, match=r"deadline 0\.900000 s is infeasible"):
        choose_plan(out, "deadline", 0.9)
    with pytest.raises(ConfigError, match="must be >= 1"):
        choose_plan(out, "max-slowdown", 0.9)
    with pytest.raises(ConfigError, match="needs a value"):
        choose_plan(out, "deadline")
    with pytest.raises(ConfigError, match="unknown policy"):
        parse_policy("fastest")
    with pytest.raises(ConfigError, match="takes no value"):
        parse_policy("min-energy", 3.0)
    with pytest.raises(ConfigError, match=r"frontier\.csv: missing"):
        choose_plan(tmp_path, "no-slowdown")
    # Beyond the rounding bound, a slower fastest plan is a real slowdown: refuse.
    out2 = _write_frontier(
        tmp_path / "g", [("0", 1.5, 60.0), ("1", 1.01, 90.0), ("allmax", 1.0, 100.0)]
    )
    with pytest.raises(ConfigError, match="no plan within"):
        choose_plan(out2, "no-slowdown")


def _job(pp: int, dp: int = 1) -> tuple[JobInfo, list[RankInfo]]:
    job = JobInfo(job_id="j", pp_degree=pp, dp_degree=dp, tp_degree=1, world_size=pp * dp)
    ranks = [
        RankInfo(rank=r, dp_rank=r // pp, pp_rank=r % pp, tp_rank=0, available_frequencies=CLOCKS)
        for r in range(pp * dp)
    ]
    return job, ranks


def test_frontier_scheduler_switches_on_target(exact_run) -> None:
    from schedulers.frontier import FrontierScheduler, FrontierScheduler3D

    _, result = exact_run
    fr = load_frontier(result.out_dir)
    job, ranks = _job(2)
    sched = FrontierScheduler(job, ranks, frontier_dir=str(result.out_dir))
    first = sched.next_schedule()
    assert sched.current.plan == choose_plan(fr, "no-slowdown").plan
    assert first == sched.next_schedule()  # Results do not move it.
    sched.observe([])
    assert sched.next_schedule() == first
    mid = fr.points[len(fr.points) // 2]
    sched.set_target(mid.iteration_time + 1e-4)
    assert sched.current.plan == mid.plan
    plan = read_plan_file(fr.path(mid))
    assert {s.rank: s.frequencies for s in sched.next_schedule()} == {
        0: plan.stages[0],
        1: plan.stages[1],
    }
    sched.set_target(100.0)
    assert sched.current.plan == "00000"
    sched.set_target(1e-3)  # Faster than possible: the fastest plan.
    assert sched.current.plan == fr.points[-1].plan
    with pytest.raises(ConfigError):
        sched.set_target(-1.0)
    # Deterministic: a fresh scheduler given the same targets serves the same plan.
    again = FrontierScheduler(job, ranks, frontier_dir=str(result.out_dir), policy="min-energy")
    for t in (mid.iteration_time + 1e-4, 100.0, 1e-3):
        again.set_target(t)
    assert again.next_schedule() == sched.next_schedule()
    # 3D: every rank of a stage gets that stage's line.
    job3, ranks3 = _job(2, dp=2)
    with pytest.raises(ConfigError, match="FrontierScheduler3D"):
        FrontierScheduler(job3, ranks3, frontier_dir=str(result.out_dir))
    sched3 = FrontierScheduler3D(
        job3, ranks3, frontier_dir=str(result.out_dir), policy="max-slowdown", policy_arg=1.05
    )
    sched3.set_target(100.0)
    lines = {s.rank: s.frequencies for s in sched3.next_schedule()}
    zero = read_plan_file(fr.path(fr.points[0]))
    assert lines == {r: zero.stages[r % 2] for r in range(4)}
    # A clock a GPU lacks is caught when the plan is loaded.
    job, ranks = _job(2)
    ranks[1] = RankInfo(rank=1, dp_rank=0, pp_rank=1, tp_rank=0, available_frequencies=[1980])
    with pytest.raises(ConfigError, match="not among the rank's available frequencies"):
        FrontierScheduler(job, ranks, frontier_dir=str(result.out_dir), policy="min-energy")


def test_plots_write_pngs(exact_run) -> None:
    from schedulers.planning.plots import plot_run

    _, result = exact_run
    paths = plot_run(result.out_dir)
    for path in paths.values():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
