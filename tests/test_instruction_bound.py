"""Every path to the planner refuses a pipeline of more than ``max_instructions`` instructions.

``perseus optimize`` refused one; the rq planning job, FrontierScheduler's in-memory planning
and InstructionProfiler's ``then`` planned any size (a typo such as 640,000 microbatches built
millions of instructions and ran for weeks, or ran out of memory). Schedulers refuse such
arguments when the coordinator starts or when the job registers, not when planning starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
from rq import Queue

from coordinator.job_config import job_config
from coordinator.service import Coordinator
from protocol import keys
from protocol.exceptions import ConfigError, ProtocolError
from protocol.models import JobInfo, RegisterJob
from protocol.scheduler import check_scheduler_args
from schedulers.frontier import FrontierScheduler
from schedulers.instruction_profiler import InstructionProfiler
from schedulers.planning.job import enqueue_planning
from schedulers.planning.pipeline_dag import MAX_INSTRUCTIONS, check_instructions
from schedulers.planning.planner import plan_frontier
from schedulers.planning.profile_csv import read_profile_csv
from schedulers.planning.synthetic_profile import write_synthetic_profile
from tests.helpers import drain, make_settings, running
from tests.profiler_jobs import make_job
from worker_client.hook.session import CoordinatorClient


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    return write_synthetic_profile(tmp_path / "p.csv", 2, stride=12)


def _job(pp: int) -> JobInfo:
    return JobInfo(pp_degree=pp, dp_degree=1, tp_degree=1, world_size=pp)


def test_the_check_names_both_numbers_the_count_the_limit_and_how_to_raise_it() -> None:
    assert MAX_INSTRUCTIONS == 100_000
    check_instructions(2, 25_000)  # 100,000 exactly: allowed
    with pytest.raises(ConfigError) as info:
        check_instructions(2, 25_001)
    assert str(info.value).startswith(
        "stages 2 x microbatches 25001 make 100,004 instructions (2 per stage and microbatch); "
        "the planner takes at most 100,000"
    )
    assert "pass max_instructions=N to plan more" in str(info.value)
    check_instructions(2, 25_001, 100_004)
    with pytest.raises(ConfigError, match="max_instructions must be >= 1, got 0"):
        check_instructions(1, 1, 0)


@pytest.mark.timeout(60)
def test_plan_frontier_refuses_before_building_the_pipeline(tmp_path: Path, profile: Path) -> None:
    out = tmp_path / "out"
    prof = read_profile_csv(profile, num_stages=2)
    with pytest.raises(ConfigError, match="stages 2 x microbatches 640000 make 2,560,000"):
        plan_frontier(prof, 2, 640_000, out_dir=out)
    assert not out.exists()
    with pytest.raises(ConfigError, match=r"make 8 instructions .* at most 7"):
        plan_frontier(prof, 2, 2, out_dir=out, max_instructions=7)
    assert len(plan_frontier(prof, 2, 2, out_dir=out, max_instructions=8).points) > 1


@pytest.mark.timeout(60)
def test_the_rq_planning_job_is_refused_before_queueing_and_takes_the_bound_along(
    tmp_path: Path, profile: Path, r: redis.Redis
) -> None:
    prof = read_profile_csv(profile, num_stages=2)
    with pytest.raises(ConfigError, match="stages 2 x microbatches 640000 make 2,560,000"):
        enqueue_planning(r, prof, 2, 640_000, out_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match=r"make 8 instructions .* at most 7"):
        enqueue_planning(r, prof, 2, 2, out_dir=tmp_path / "a", max_instructions=7)
    assert not r.zcard(keys.PLANS_INDEX) and not Queue(keys.RQ_QUEUE, connection=r).count
    plan_id = enqueue_planning(r, prof, 2, 2, out_dir=tmp_path / "b", max_instructions=8)
    (job,) = Queue(keys.RQ_QUEUE, connection=r).jobs
    assert job.kwargs["max_instructions"] == 8
    drain(r)
    assert r.hget(keys.plan_key(plan_id), "state") == b"done"


def test_frontier_scheduler_refuses_absurd_microbatches_when_the_coordinator_starts(
    profile: Path,
) -> None:
    args = {"profile": str(profile), "microbatches": 640_000}
    for name in ("FrontierScheduler", "FrontierScheduler3D"):
        with pytest.raises(ConfigError) as info:
            make_settings("redis://localhost:1", name, scheduler_args=args).check_scheduler()
        said = str(info.value)
        assert said.startswith(f"{name}: microbatches 640000, even on 1 stage, make 1,280,000")
        assert f"set {name}'s scheduler argument max_instructions" in said, said
    with pytest.raises(ConfigError, match="max_instructions must be >= 1, got 0"):
        check_scheduler_args("FrontierScheduler", args | {"max_instructions": 0})
    # The bound goes with profile: a frontier folder was planned already.
    with pytest.raises(ConfigError, match="'max_instructions' plans from a profile only"):
        check_scheduler_args("FrontierScheduler", {"frontier_dir": "d", "max_instructions": 9})


def _registered(name: str, args: dict[str, Any], pp: int) -> None:
    """What the coordinator checks when a job of ``pp`` stages registers under its settings."""
    settings = make_settings("redis://localhost:1", name, scheduler_args=args)
    job_config(settings, RegisterJob(request_id="r1", job=_job(pp)))


def test_frontier_scheduler_refuses_a_job_of_too_many_stages_when_it_registers(
    profile: Path,
) -> None:
    args: dict[str, Any] = {"profile": str(profile), "microbatches": 1024}
    _registered("FrontierScheduler", args, 48)  # 98,304 instructions
    with pytest.raises(ConfigError) as info:
        _registered("FrontierScheduler3D", args, 64)
    assert str(info.value).startswith(
        "FrontierScheduler3D: pp_degree 64 x microbatches 1024 make 131,072 instructions"
    )
    _registered("FrontierScheduler", args | {"max_instructions": 131_072}, 64)


def test_frontier_scheduler_checks_before_reading_its_profile(profile: Path) -> None:
    job, ranks = make_job(pp=2, dp=1)
    with pytest.raises(ConfigError, match="pp_degree 2 x microbatches 4 make 16 instructions"):
        FrontierScheduler(job, ranks, profile=str(profile), microbatches=4, max_instructions=15)
    FrontierScheduler(job, ranks, profile=str(profile), microbatches=4, max_instructions=16)


def test_the_profilers_then_is_bounded_at_start_at_registration_and_when_built(
    tmp_path: Path,
) -> None:
    # The profiler caps microbatches at 65,536: 2 x stages x 65,536 reached the planner.
    then = {"out_dir": str(tmp_path / "plans")}
    with pytest.raises(ConfigError) as info:
        check_scheduler_args("InstructionProfiler", {"microbatches": 65_536, "then": then})
    said = str(info.value)
    assert "microbatches 65536, even on 1 stage, make 131,072 instructions" in said, said
    assert "set then's max_instructions" in said, said
    check_scheduler_args("InstructionProfiler", {"microbatches": 65_536})  # no planning: fine
    with pytest.raises(ConfigError, match=r"then: max_instructions must be >= 1, got 0"):
        check_scheduler_args(
            "InstructionProfiler", {"microbatches": 2, "then": then | {"max_instructions": 0}}
        )

    args: dict[str, Any] = {"microbatches": 30_000, "then": then}
    _registered("InstructionProfiler", {"microbatches": 30_000}, 2)
    with pytest.raises(ConfigError, match="pp_degree 2 x microbatches 30000 make 120,000"):
        _registered("InstructionProfiler", args, 2)
    raised = args | {"then": then | {"max_instructions": 120_000}}
    _registered("InstructionProfiler", raised, 2)

    job, ranks = make_job(pp=2, dp=1)
    with pytest.raises(ConfigError, match="pp_degree 2 x microbatches 30000 make 120,000"):
        InstructionProfiler(job, ranks, **args)
    built = InstructionProfiler(job, ranks, **raised).then
    assert built is not None and built["max_instructions"] == 120_000


def test_a_registration_over_the_bound_is_refused_with_the_reason(
    r: redis.Redis, redis_url: str, profile: Path
) -> None:
    args = {"profile": str(profile), "microbatches": 1024}
    settings = make_settings(redis_url, "FrontierScheduler", scheduler_args=args)
    with running(Coordinator(r, settings, claim_idle_ms=60_000)):
        client = CoordinatorClient(redis_url, reply_timeout=10)
        with pytest.raises(ProtocolError, match="pp_degree 64 x microbatches 1024 make 131,072"):
            client.register_job(_job(64))
        assert not r.zcard(keys.JOBS_INDEX)
        assert client.register_job(_job(2))
