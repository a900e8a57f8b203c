"""PointSolution and PointSolution3D: serving one plan file."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from protocol.exceptions import ConfigError, ProtocolError
from protocol.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from protocol.scheduler import build_scheduler, check_scheduler_args, resolve_scheduler
from schedulers.planning.pipeline_dag import one_f_one_b_order
from schedulers.planning.plan_file import write_plan_file
from schedulers.point_solution import PointSolution, PointSolution3D

H100 = list(range(1980, 344, -15))


def job(pp: int, dp: int = 1, tp: int = 1) -> JobInfo:
    return JobInfo(
        job_id="job-1", pp_degree=pp, dp_degree=dp, tp_degree=tp, world_size=pp * dp * tp
    )


def ranks(pp: int, dp: int = 1, tp: int = 1, freqs: list[int] | None = None) -> list[RankInfo]:
    """Megatron-style layout: tp fastest, then dp, then pp."""
    infos = []
    for rank, (p, d, t) in enumerate(itertools.product(range(pp), range(dp), range(tp))):
        infos.append(
            RankInfo(
                rank=rank,
                dp_rank=d,
                pp_rank=p,
                tp_rank=t,
                available_frequencies=list(freqs or H100),
            )
        )
    return infos


def plan_stages(pp: int, microbatches: int) -> list[list[tuple[str, int]]]:
    return [
        [
            (name, 1980 - 15 * (s * 3 + i))
            for i, name in enumerate(one_f_one_b_order(pp, microbatches, s))
        ]
        for s in range(pp)
    ]


@pytest.fixture
def plan4(tmp_path: Path) -> tuple[Path, list[list[tuple[str, int]]]]:
    stages = plan_stages(4, 4)
    path = tmp_path / "freqs_pipeline_00007.py"
    write_plan_file(path, stages, {"iteration_time": 1.0}, ["perseus plan 00007"])
    return path, stages


def result(rank: int, version: int = 0) -> ProfilingResult:
    return ProfilingResult(
        rank=rank, schedule_version=version, iter_time=[1.0], iter_energy=[100.0]
    )


def test_serves_plan_to_each_rank(plan4: tuple[Path, list[list[tuple[str, int]]]]) -> None:
    path, stages = plan4
    # Rank infos arrive in any order.
    sched = PointSolution(job(4), list(reversed(ranks(4))), solution_path=str(path))
    first = sched.next_schedule()
    assert sorted(s.rank for s in first) == [0, 1, 2, 3]
    for sched_rank in first:
        assert sched_rank.frequencies == stages[sched_rank.rank]
    # The generator has finished: the same plan is served forever.
    sched.observe([result(r) for r in range(4)])
    assert sched.next_schedule() == first
    sched.observe([result(r) for r in range(4)])
    assert sched.next_schedule() == first


def test_wrong_stage_count_names_file_and_hints_3d(
    plan4: tuple[Path, list[list[tuple[str, int]]]],
) -> None:
    path, _ = plan4
    with pytest.raises(ConfigError) as info:
        PointSolution(job(2), ranks(2), solution_path=str(path))
    text = str(info.value)
    assert str(path) in text and "4 stage lists" in text and "needs 2" in text
    assert "PointSolution3D" not in text

    # 4 stages, dp=2: world_size 8 does not match, and the hint points at PointSolution3D.
    with pytest.raises(ConfigError, match=r"has 4 stage lists .* needs 8.*PointSolution3D"):
        PointSolution(job(4, dp=2), ranks(4, dp=2), solution_path=str(path))


def test_unsupported_frequency_names_rank_and_instruction(tmp_path: Path) -> None:
    stages = plan_stages(2, 2)
    stages[1][3] = ("backward", 1234)
    path = tmp_path / "plan.py"
    write_plan_file(path, stages, {})
    with pytest.raises(ConfigError) as info:
        PointSolution(job(2), ranks(2), solution_path=str(path))
    text = str(info.value)
    assert str(path) in text
    assert "rank 1, instruction 3 (backward): frequency 1234 MHz" in text


def test_frequency_checked_per_rank(tmp_path: Path) -> None:
    # Rank 1's GPU tops out at 1500 MHz; a plan asking it for 1980 is refused.
    stages = [[("forward", 1980), ("backward", 1980)], [("forward", 1980), ("backward", 1500)]]
    path = tmp_path / "plan.py"
    write_plan_file(path, stages, {})
    infos = ranks(2)
    infos[1] = infos[1].model_copy(update={"available_frequencies": [1500, 1200]})
    with pytest.raises(ConfigError, match="rank 1, instruction 0"):
        PointSolution(job(2), infos, solution_path=str(path))


def test_missing_file_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="plan file not found"):
        PointSolution(job(2), ranks(2), solution_path=str(tmp_path / "missing.py"))


def test_missing_rank_info(plan4: tuple[Path, list[list[tuple[str, int]]]]) -> None:
    path, _ = plan4
    with pytest.raises(ProtocolError, match=r"ranks \[2\] have not registered"):
        PointSolution(job(4), [r for r in ranks(4) if r.rank != 2], solution_path=str(path))


def test_3d_serves_stage_plan_to_every_rank(
    plan4: tuple[Path, list[list[tuple[str, int]]]],
) -> None:
    path, stages = plan4
    infos = ranks(4, dp=2)
    sched = PointSolution3D(job(4, dp=2), infos, solution_path=str(path))
    schedules = sched.next_schedule()
    assert len(schedules) == 8
    assert sorted(s.rank for s in schedules) == list(range(8))
    pp_of = {r.rank: r.pp_rank for r in infos}
    for s in schedules:
        assert isinstance(s, FrequencySchedule)
        assert s.frequencies == stages[pp_of[s.rank]]


def test_3d_wrong_stage_count(tmp_path: Path) -> None:
    path = tmp_path / "plan.py"
    write_plan_file(path, plan_stages(2, 2), {})
    with pytest.raises(ConfigError, match=r"plan\.py: plan has 2 stage lists .* needs 4"):
        PointSolution3D(job(4, dp=2), ranks(4, dp=2), solution_path=str(path))


def test_registry_finds_both() -> None:
    assert resolve_scheduler("PointSolution") is PointSolution
    assert resolve_scheduler("PointSolution3D") is PointSolution3D
    assert PointSolution3D.__name__ == "PointSolution3D"
    assert (PointSolution3D.__doc__ or "").startswith("[3D-parallel] ")


@pytest.mark.parametrize("name", ["PointSolution", "PointSolution3D"])
def test_scheduler_args_checked(name: str) -> None:
    with pytest.raises(ConfigError, match="solution_path"):
        check_scheduler_args(name, {})
    with pytest.raises(ConfigError, match="solution_path"):
        check_scheduler_args(name, {"solution_path": "x.py", "extra": 1})
    check_scheduler_args(name, {"solution_path": "x.py"})


def test_build_scheduler(plan4: tuple[Path, list[list[tuple[str, int]]]]) -> None:
    path, stages = plan4
    sched = build_scheduler(
        "PointSolution3D", job(4, tp=2), ranks(4, tp=2), {"solution_path": str(path)}
    )
    by_rank = {s.rank: s.frequencies for s in sched.next_schedule()}
    assert by_rank[0] == by_rank[1] == stages[0]
    assert by_rank[6] == by_rank[7] == stages[3]


def test_a_scheduler_written_for_zeus_is_told_to_drop_pfo_settings() -> None:
    with pytest.raises(ConfigError, match=r"takes Zeus's pfo_settings.*drop that parameter"):
        check_scheduler_args("tests.toy_schedulers:ZeusStyle", {"pfo_settings": {}})


def test_3d_wrong_stage_count_describes_the_real_job(
    plan4: tuple[Path, list[list[tuple[str, int]]]], tmp_path: Path
) -> None:
    # The 3D wrapper's scheduler sees a pipeline view (world_size = pp, dp = tp = 1); the
    # message said "needs 2, one per rank (pp_degree=2, dp_degree=1, ...)" for this 4-rank job.
    path, _ = plan4
    with pytest.raises(ConfigError) as info:
        PointSolution3D(job(2, dp=2), ranks(2, dp=2), solution_path=str(path))
    assert str(info.value) == (
        f"{path}: plan has 4 stage lists but job job-1 needs 2, one per pipeline stage "
        "(pp_degree=2; its 4 ranks, dp_degree=2 x tp_degree=1 per stage, each run their "
        "stage's list)"
    )
    from schedulers.frontier import FrontierScheduler3D
    from schedulers.planning.planner import plan_frontier
    from schedulers.planning.synthetic_profile import synthetic_profile

    out = tmp_path / "frontier2"
    plan_frontier(synthetic_profile(2, stride=24), 2, 2, out_dir=out, unit_time=0.004)
    with pytest.raises(ConfigError, match=r"job job-1 needs 3, one per pipeline stage .*6 ranks"):
        FrontierScheduler3D(job(3, dp=2), ranks(3, dp=2), frontier_dir=str(out))
