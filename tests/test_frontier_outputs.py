"""Planner output folder: one time per plan, allmax.csv, dominated plans, no stale files."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from protocol.exceptions import ConfigError
from schedulers.planning.choose import POLICIES, choose_plan, select_point
from schedulers.planning.frontier_files import (
    Frontier,
    FrontierPoint,
    load_frontier,
    mark_dominated,
)
from schedulers.planning.pipeline_dag import PipelineShape
from schedulers.planning.plan_file import read_plan_file
from schedulers.planning.planner import plan_frontier
from schedulers.planning.profile_csv import read_profile_csv
from schedulers.planning.synthetic_profile import synthetic_profile, write_synthetic_profile
from tests.helpers import planner_cli

P2P_W = 50.0  # Enough blocking power that the slowest plans cost more energy than faster ones.


def _optimize(profile: Path, out: Path, *extra: str) -> str:
    args = ["optimize", str(profile), "-s", "2", "-m", "4", "--out", str(out), *extra]
    res = CliRunner().invoke(planner_cli(), args)
    assert res.exit_code == 0, res.output
    return res.output


def _longest_path(out: Path, plan_file: Path) -> float:
    """Iteration time recomputed from profile.csv and the plan's clocks, independently."""
    table = read_profile_csv(out / "profile.csv").table
    stages = read_plan_file(plan_file).stages
    shape = PipelineShape(len(stages), 4)
    durations = []
    for s, name, m in shape.nodes:  # Microbatch m's instruction is the m-th of its kind.
        clocks = [f for n, f in stages[s] if n == name]
        durations.append(table[(s, name)][clocks[m]][0])
    return shape.makespan(durations)


def test_one_time_per_plan_in_csv_choose_and_plots(tmp_path: Path) -> None:
    profile = write_synthetic_profile(tmp_path / "p.csv", 2, stride=12)
    out = tmp_path / "out"
    _optimize(profile, out, "--unit-time", "0.002", "--p2p-power", "5")
    fr = load_frontier(out)
    for point in (fr.points[0], fr.points[len(fr.points) // 2], fr.points[-1]):
        # The CSV's time is the real longest path at the plan's clocks (not the solver's units).
        assert point.iteration_time == pytest.approx(_longest_path(out, fr.path(point)), abs=1e-12)
    res = CliRunner().invoke(
        planner_cli(), ["choose", str(out), "-p", "min-energy", "--json", "--plot"]
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    point = fr.point(data["plan"])
    assert data["iteration_time"] == point.iteration_time
    res = CliRunner().invoke(planner_cli(), ["choose", str(out), "-p", "min-energy"])
    assert f"iteration time: {point.iteration_time:.4f} s" in res.output
    assert f"(all-max {fr.allmax.iteration_time:.4f} s" in res.output
    assert res.output.count("times:") == 1 and "0.1 ms" in res.output
    assert "iteration_time" in fr.meta and "longest dependency path" in fr.meta["iteration_time"]


def test_allmax_has_its_own_file(tmp_path: Path) -> None:
    out = tmp_path / "out"
    plan_frontier(synthetic_profile(2, stride=12), 2, 4, out_dir=out, unit_time=0.002)
    with open(out / "frontier.csv", newline="") as f:
        plans = [row["plan"] for row in csv.DictReader(f)]
    assert plans and all(p.isdigit() for p in plans)
    with open(out / "allmax.csv", newline="") as f:
        assert [row["plan"] for row in csv.DictReader(f)] == ["allmax"]
    assert load_frontier(out).allmax.plan == "allmax"
    # An old-style frontier.csv with the allmax row among the plans is refused by name.
    text = (out / "frontier.csv").read_text() + (out / "allmax.csv").read_text().split("\n")[1]
    (out / "frontier.csv").write_text(text + "\n")
    with pytest.raises(ConfigError, match=r"frontier\.csv:\d+: field 'plan': expected a plan"):
        load_frontier(out)
    (out / "allmax.csv").unlink()
    with pytest.raises(ConfigError, match=r"allmax\.csv: missing"):
        load_frontier(out)


def test_a_frontier_with_every_plan_dominated_is_refused_naming_the_file(tmp_path: Path) -> None:
    # A truncated or hand-edited frontier.csv: perseus choose and the coordinator's start
    # check (FrontierScheduler.check_files) said "min() arg is an empty sequence".
    from schedulers.frontier import FrontierScheduler

    out = tmp_path / "out"
    plan_frontier(synthetic_profile(2, stride=12), 2, 4, out_dir=out, unit_time=0.002)
    path = out / "frontier.csv"
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row["dominated"] = "1"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    words = f"{path}: every one of its {len(rows)} plans is marked dominated"
    res = CliRunner().invoke(planner_cli(), ["choose", str(out), "--policy", "no-slowdown"])
    assert res.exit_code != 0 and words in res.output, res.output
    with pytest.raises(ConfigError, match=r"every one of its \d+ plans is marked dominated"):
        FrontierScheduler.check_files({"frontier_dir": str(out)})
    # A Frontier built in code with no such plan: the same kind of error, not min()'s.
    allmax = _point("allmax", 1.0, 10.0)
    frontier = Frontier(out, [replace(_point("00000", 2.0, 9.0), dominated=True)], allmax)
    with pytest.raises(ConfigError, match=r"frontier\.csv: no plan that is not dominated"):
        select_point(frontier, "min-energy")


def _point(plan: str, t: float, e: float) -> FrontierPoint:
    return FrontierPoint(plan, t, e, e, quant_time=0, file=f"freqs_pipeline_{plan}.py")


def test_mark_dominated_rules() -> None:
    pts = [
        _point("00000", 3.0, 12.0),  # Slower and dearer than 00002: dominated.
        _point("00001", 2.5, 10.0),  # Equal to 00002 in both: kept.
        _point("00002", 2.5, 10.0),
        _point("00003", 2.5, 11.0),  # Same time, more energy: dominated.
        _point("00004", 2.0, 12.0),  # Faster, more energy: on the frontier.
        _point("00005", 1.5, 12.0),  # Faster than 00004 at equal energy: 00004 is dominated.
    ]
    flags = [p.dominated for p in mark_dominated(pts)]
    assert flags == [True, False, False, True, True, False]


def test_dominated_plans_are_marked_and_never_chosen(tmp_path: Path) -> None:
    out = tmp_path / "out"
    plan_frontier(
        synthetic_profile(2, stride=12), 2, 4, out_dir=out, unit_time=0.002, p2p_power=P2P_W
    )
    fr = load_frontier(out)  # What readers see: the CSV's column.
    pts = fr.points
    stages = [read_plan_file(fr.path(p)).stages for p in pts]
    for k, p in enumerate(pts):
        beaten = any(
            q.iteration_time <= p.iteration_time
            and q.energy_with_p2p <= p.energy_with_p2p
            and (q.iteration_time, q.energy_with_p2p) != (p.iteration_time, p.energy_with_p2p)
            for q in pts
        )
        repeat = stages[k] in stages[:k]  # An earlier plan with the same clocks.
        assert p.dominated == (beaten or repeat), p
    least = min(pts, key=lambda p: p.energy_with_p2p)
    slower = [p for p in pts if p.iteration_time > least.iteration_time]
    assert slower and all(p.dominated for p in slower)  # The case the issue names.
    assert fr.meta["num_dominated"] == sum(p.dominated for p in pts) > 0
    times = sorted({p.iteration_time for p in pts})
    for policy in POLICIES:
        values = (
            [None]
            if policy in ("no-slowdown", "min-energy")
            else [1.0, 1.05, 1.3, 2.0]
            if policy == "max-slowdown"
            else [t + d for t in times for d in (-1e-4, 0.0, 1e-4)]
        )
        for value in values:
            try:
                point, _, _ = select_point(fr, policy, value)
            except ConfigError:
                continue  # An infeasible deadline.
            assert not point.dominated, (policy, value, point)
    assert choose_plan(out, "min-energy").plan == least.plan


def test_a_plan_repeated_by_later_solver_steps_counts_once(tmp_path: Path) -> None:
    # Solver steps are whole time units: consecutive steps can round to the same clocks. The
    # first stays on the frontier, the repeats are marked dominated, and the count says so.
    profile = write_synthetic_profile(tmp_path / "p.csv", 2, stride=12)
    out = tmp_path / "out"
    printed = _optimize(profile, out, "--unit-time", "0.002", "--p2p-power", "70")
    fr = load_frontier(out)
    stages = [read_plan_file(fr.path(p)).stages for p in fr.points]
    repeats = [k for k in range(len(stages)) if stages[k] in stages[:k]]
    assert repeats  # This profile's solver steps repeat plans.
    pareto = [stages[p.index] for p in fr.pareto]
    assert all(pareto.count(s) == 1 for s in pareto)  # Each distinct plan once.
    assert all(fr.points[k].dominated for k in repeats)
    for k in repeats:  # Time and energies came from the clocks: the same as the first's.
        first = fr.points[stages.index(stages[k])]
        same = (first.iteration_time, first.energy, first.energy_with_p2p)
        assert (
            fr.points[k].iteration_time,
            fr.points[k].energy,
            fr.points[k].energy_with_p2p,
        ) == same
    summary = f"\n{len(pareto)} Pareto-optimal plans ({len(fr.points) - len(pareto)} dominated)"
    assert summary in printed  # perseus optimize's summary line
    assert fr.meta["num_dominated"] == len(fr.points) - len(pareto)


def test_rerun_leaves_no_stale_files_and_images_are_named_alike(tmp_path: Path) -> None:
    profile = write_synthetic_profile(tmp_path / "p.csv", 2, stride=12)
    out = tmp_path / "out"
    _optimize(profile, out, "--unit-time", "0.001")
    first = load_frontier(out)
    res = CliRunner().invoke(planner_cli(), ["choose", str(out), "-p", "min-energy", "--plot"])
    assert res.exit_code == 0, res.output
    least = choose_plan(out, "min-energy").plan
    fastest = choose_plan(out, "no-slowdown").plan
    assert {p.name for p in out.glob("*.png")} == {
        "frontier.png",
        f"timeline_{least}.png",
        f"timeline_{fastest}.png",
    }
    (out / "plan.png").write_bytes(b"old")  # Names older versions wrote.
    (out / "frontier_00001.png").write_bytes(b"old")
    (out / "notes.txt").write_text("mine")  # Not the planner's: kept.

    _optimize(profile, out, "--unit-time", "0.004", "--no-plot")
    second = load_frontier(out)
    assert len(second.points) < len(first.points)
    assert not list(out.glob("*.png"))
    assert {p.name for p in out.glob("freqs_pipeline_*.py")} == {p.file for p in second.points}
    assert (out / "notes.txt").read_text() == "mine"


def test_an_output_path_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    """Not a traceback: the path and why (a read-only folder reads the same way)."""
    profile = write_synthetic_profile(tmp_path / "p.csv", 2, stride=12)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = ["optimize", str(profile), "-s", "2", "-m", "4", "--out", str(blocker / "out")]
    res = CliRunner().invoke(planner_cli(), args)
    assert res.exit_code == 1 and res.exception is not None, res.output
    assert f"Error: {blocker / 'out'}: Not a directory" in res.output
    out = tmp_path / "out"
    _optimize(profile, out)
    (out / "frontier.png").unlink(missing_ok=True)
    (out / "frontier.png").mkdir()  # where choose --plot draws
    res = CliRunner().invoke(planner_cli(), ["choose", str(out), "--plot"])
    assert res.exit_code == 1 and f"Error: {out / 'frontier.png'}: Is a directory" in res.output


def test_the_rounding_statement_holds_for_every_plan(tmp_path: Path) -> None:
    """What `perseus optimize` and frontier.json say about quant_time is true of each plan.

    The real time exceeds the solver's by less than rounding_bound; the other way there is no
    bound (an instruction runs at the slowest clock that fits its solver duration, which can be
    much faster when clocks are far apart). Both used to say "differ by less than".
    """
    profile = write_synthetic_profile(tmp_path / "p.csv", 2, stride=24, base_forward_time=0.05)
    out = tmp_path / "out"
    said = _optimize(profile, out, "--unit-time", "0.002")
    fr = load_frontier(out)
    unit, bound = fr.meta["unit_time"], fr.rounding_bound
    for point in fr.points:
        assert point.iteration_time - point.quant_time * unit < bound
    assert any(p.quant_time * unit - p.iteration_time > bound for p in fr.points)
    assert "exceeds quant_time * unit_time by less than rounding_bound" in fr.meta["iteration_time"]
    assert "differ" not in fr.meta["iteration_time"]
    rounding = next(line for line in said.splitlines() if line.startswith("rounding:"))
    assert f"these times exceed its quantized ones by < {bound:.4f} s" in rounding
    assert "differ" not in rounding
