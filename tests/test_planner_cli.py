"""`perseus optimize` and `choose` on the command line, their refusals, and planning in rq."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from protocol import keys
from protocol.exceptions import ConfigError
from schedulers.planning.choose import choose_plan
from schedulers.planning.core_problem import MAX_TABLE_UNITS
from schedulers.planning.frontier_files import load_frontier
from schedulers.planning.planner import pareto_frequencies, plan_frontier
from schedulers.planning.profile_csv import read_profile_csv
from schedulers.planning.synthetic_profile import (
    synthetic_profile,
    write_synthetic_profile,
)
from tests.helpers import planner_cli


def _optimized(tmp_path: Path, runner: CliRunner, out: Path) -> tuple[Path, str]:
    """`perseus optimize` of a 2-stage synthetic profile into ``out``: the profile, output."""
    profile = write_synthetic_profile(tmp_path / "p.csv", 2, stride=12)
    res = runner.invoke(
        planner_cli(),
        ["optimize", str(profile), "-s", "2", "-m", "2", "--out", str(out), "--unit-time", "0.002"],
    )
    assert res.exit_code == 0, res.output
    return profile, res.output


def test_cli_optimize_and_choose(tmp_path: Path) -> None:
    out = tmp_path / "out"
    runner = CliRunner()
    profile, output = _optimized(tmp_path, runner, out)
    assert "no slowdown:" in output and "rounding:" in output
    assert (out / "frontier.png").is_file()
    res = runner.invoke(
        planner_cli(), ["choose", str(out), "--policy", "max-slowdown 1.1", "--plot"]
    )
    assert res.exit_code == 0, res.output
    assert "saving:" in res.output and "frontier plot:" in res.output
    res = runner.invoke(planner_cli(), ["choose", str(out), "-p", "deadline", "--value", "0.001"])
    assert res.exit_code == 1 and "infeasible" in res.output
    res = runner.invoke(
        planner_cli(), ["optimize", str(profile), "-s", "3", "-m", "2", "--out", str(out)]
    )
    assert res.exit_code == 1 and "no rows for stage 2" in res.output


def test_optimize_warns_about_a_profile_that_can_plan_nothing(tmp_path: Path) -> None:
    # All energies 0 J (nothing measured) and 0.1 ms instructions at the default 1 ms unit.
    rows = ["stage,instruction,frequency,time,energy"]
    rows += [f"0,{i},{f},0.0001,0.0" for i in ("forward", "backward") for f in (1980, 1500)]
    profile = tmp_path / "zero.csv"
    profile.write_text("\n".join(rows) + "\n")
    res = CliRunner().invoke(
        planner_cli(),
        ["optimize", str(profile), "-s", "1", "-m", "2", "--out", str(tmp_path / "o")],
    )
    assert "warning: every energy in" in res.output and "is 0 J" in res.output
    assert "4 of 4 instruction times are under unit_time (0.001 s)" in res.output


def test_optimize_without_p2p_power_says_blocking_energy_is_not_counted(tmp_path: Path) -> None:
    # Zeus's run_optimization.py assumed 70 W where --p2p_power was left out; a plan made
    # with 0 W here was chosen as if waiting on a neighbour stage cost no energy, unsaid.
    profile = write_synthetic_profile(tmp_path / "p.csv", 2, stride=12)
    args = ["optimize", str(profile), "-s", "2", "-m", "2", "--no-plot", "--plans", "chosen"]
    res = CliRunner().invoke(planner_cli(), [*args, "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    assert "warning: --p2p-power not given: planning with 0 W" in res.output
    assert "perseus profile-p2p" in res.output
    for watts in ("0", "70"):  # given, even as 0 W: no warning
        res = CliRunner().invoke(
            planner_cli(), [*args, "--out", str(tmp_path / watts), "--p2p-power", watts]
        )
        assert res.exit_code == 0 and "--p2p-power not given" not in res.output, res.output


@pytest.mark.timeout(60)
@pytest.mark.parametrize("unit_time", ["1e-9", "1e-300"])
def test_a_unit_time_too_fine_to_plan_is_refused_before_planning(
    tmp_path: Path, unit_time: str
) -> None:
    """1e-9 s ran for minutes and 1e-300 s for ever: a table entry per unit per instruction."""
    profile = write_synthetic_profile(tmp_path / "p.csv", 2, stride=12)
    out = tmp_path / "out"
    args = ["optimize", str(profile), "-s", "2", "-m", "2", "--out", str(out), "--no-plot"]
    res = CliRunner().invoke(planner_cli(), [*args, "--unit-time", unit_time])
    assert res.exit_code == 1, res.output
    assert f"{profile}: unit time {float(unit_time):g} s is too fine: stage 0 forward" in res.output
    suggested = float(res.output.rsplit("at least ", 1)[1].split()[0])
    res = CliRunner().invoke(planner_cli(), [*args, "--unit-time", str(suggested * 100)])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("unit_time", [1e-9, 1e-320])
def test_the_unit_time_a_refusal_suggests_fits_every_instruction(
    tmp_path: Path, unit_time: float
) -> None:
    """It named a unit for the first instruction refused; a wider one was refused next.

    1e-320 s (a time / unit past the largest float) raised OverflowError instead.
    """
    profile = synthetic_profile(2, stride=12)
    with pytest.raises(ConfigError, match="is too fine") as refused:
        plan_frontier(profile, 2, 2, out_dir=tmp_path / "out", unit_time=unit_time)
    suggested = float(str(refused.value).rsplit("at least ", 1)[1].split()[0])
    for (stage, inst), entry in profile.table.items():
        times = [entry[f][0] for f in pareto_frequencies(entry)]
        width = math.floor(max(times) / suggested) - math.floor(min(times) / suggested)
        assert width <= MAX_TABLE_UNITS, (stage, inst, width)


def test_enqueue_runs_on_rq_worker(tmp_path: Path, redis_url: str) -> None:
    from rq import Queue, SimpleWorker

    conn = redis.Redis.from_url(redis_url)
    profile = write_synthetic_profile(tmp_path / "p.csv", 2, stride=12)
    out = tmp_path / "plans"
    res = CliRunner().invoke(
        planner_cli(),
        [
            "optimize",
            str(profile),
            "-s",
            "2",
            "-m",
            "2",
            "--out",
            str(out),
            "--unit-time",
            "0.002",
            "--solver",
            "python",
            "--plans",
            "chosen",
            "--enqueue",
            "--redis-url",
            redis_url,
        ],
    )
    assert res.exit_code == 0, res.output
    plan_id = res.output.split("plan id: ")[1].split()[0]
    key = keys.plan_key(plan_id)
    assert conn.hget(key, "state") == b"queued"
    assert "HGETALL " + key in res.output
    assert conn.zscore(keys.PLANS_INDEX, plan_id) is not None

    queue = Queue(keys.RQ_QUEUE, connection=conn)
    SimpleWorker([queue], connection=conn).work(burst=True)
    state = {k.decode(): v.decode() for k, v in conn.hgetall(key).items()}
    assert state["state"] == "done", state
    assert float(state["progress"]) == 1.0
    assert int(state["num_plans"]) == len(load_frontier(out).points) > 1
    assert state["out_dir"] == str(out.resolve())
    meta = load_frontier(out).meta
    assert meta["solver"] == "python" and meta["plan_files"] == "chosen"
    chosen = {choose_plan(out, p).file.name for p in ("no-slowdown", "min-energy")}
    assert {p.name for p in out.glob("freqs_pipeline_*.py")} == chosen
    assert (out / "frontier.png").is_file()

    # A job that fails reports it.
    from schedulers.planning.job import enqueue_planning

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    bad = enqueue_planning(conn, read_profile_csv(profile), 2, 2, out_dir=blocker / "x")
    SimpleWorker([queue], connection=conn).work(burst=True)
    assert conn.hget(keys.plan_key(bad), "state") == b"failed"
    assert conn.hget(keys.plan_key(bad), "message")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["here", "--enqueue"])
def test_optimize_refuses_a_pipeline_too_large_to_plan_before_building_it(
    tmp_path: Path, where: str
) -> None:
    """``-m 640000`` (a typo for 64) built a DAG of millions of instructions: hung, or OOM."""
    profile = write_synthetic_profile(tmp_path / "p.csv", 2, stride=12)
    out = tmp_path / "out"
    args = ["optimize", str(profile), "-s", "2", "-m", "640000", "--out", str(out), "--no-plot"]
    if where == "--enqueue":  # refused before Redis is asked (none listens on port 1)
        args += ["--enqueue", "--redis-url", "redis://127.0.0.1:1/0"]
    res = CliRunner().invoke(planner_cli(), args)
    assert res.exit_code == 2, res.output
    assert (
        "--stages 2 x --microbatches 640000 make 2,560,000 instructions (2 per stage and "
        "microbatch); the planner takes at most 100,000" in res.output
    ), res.output
    assert "--max-instructions" in res.output and not out.exists(), res.output


def test_max_instructions_lets_a_larger_pipeline_be_planned(tmp_path: Path) -> None:
    profile = write_synthetic_profile(tmp_path / "p.csv", 2, stride=12)
    args = ["optimize", str(profile), "-s", "2", "-m", "2", "--no-plot", "--plans", "chosen"]
    res = CliRunner().invoke(
        planner_cli(), [*args, "--out", str(tmp_path / "a"), "--max-instructions", "7"]
    )
    assert res.exit_code == 2 and "make 8 instructions" in res.output, res.output
    assert "the planner takes at most 7" in res.output, res.output
    res = CliRunner().invoke(
        planner_cli(), [*args, "--out", str(tmp_path / "b"), "--max-instructions", "8"]
    )
    assert res.exit_code == 0, res.output


def test_choose_copy_to_puts_the_chosen_plan_where_the_stack_reads_it(tmp_path: Path) -> None:
    # README (docker compose): the stack serves ./plans/plan.py; a first user had to find the
    # chosen plan's number in the output and copy it by hand.
    out = tmp_path / "frontier"
    runner = CliRunner()
    _optimized(tmp_path, runner, out)
    target = tmp_path / "plans" / "plan.py"
    res = runner.invoke(planner_cli(), ["choose", str(out), "--copy-to", str(target)])
    assert res.exit_code == 0, res.output
    chosen = choose_plan(out, "no-slowdown").file
    assert target.read_bytes() == chosen.read_bytes()
    assert f"copied to:      {target}" in res.output
