"""A rank that fails while the ranks start fails every rank at once, naming it and why (gloo)."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest

from protocol import keys
from protocol.models import FrequencySchedule, JournalEntry
from protocol.pipeline_schedules import stage_actions
from protocol.store import JobStore
from schedulers.planning.pipeline_dag import one_f_one_b_order
from schedulers.planning.plan_file import write_plan_file
from tests.helpers import free_ports, wait_for
from tests.pipelining_ranks import PipelineRank, start_rank
from tests.rank_helpers import join_ranks, spawn_ranks
from worker_client.simulated.gpu import synthetic_instruction_table
from worker_client.simulated.training import launch_simulated_job

# Every rank process gets this process-group timeout: a rank left waiting in a collective
# (what these tests guard against) fails the test in seconds, not gloo's 30 minutes.
PG_TIMEOUT_S = 20.0


def run_two_ranks(
    redis_url: str, tmp_path: Path, meta: str, rank_options: dict[int, dict[str, Any]]
) -> list[str]:
    """Start a two-stage job whose ranks take ``rank_options``; each rank's error (or "")."""
    procs = spawn_ranks(
        2,
        2,
        redis_url,
        tmp_path,
        meta,
        steps=1,
        microbatches=2,
        rank_options=rank_options,
        pg_timeout_s=PG_TIMEOUT_S,
    )
    join_ranks(procs, 120)
    records = [json.loads((tmp_path / f"{meta}-rank{k}.json").read_text()) for k in range(2)]
    return [str(rec.get("error", "")) for rec in records]


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"report_every": 0}, "ConfigError: report_every must be >= 1, got 0"),
        (
            {"redis_url": "redis://127.0.0.1:notaport"},
            "ConfigError: invalid Redis URL 'redis://127.0.0.1:notaport'",
        ),
    ],
)
def test_a_rank_with_a_bad_argument_fails_every_rank_before_a_job_exists(
    r, redis_url, tmp_path, options, why
):
    # Rank 1 raised before the join's first collective (checking its arguments, making its
    # Redis client) and rank 0 waited there: gloo's "Connection closed by peer" once rank 1's
    # process was gone, gloo's timeout (30 minutes by default) while it lived on.
    errors = run_two_ranks(redis_url, tmp_path, "bad-argument", {1: options})
    assert why in errors[1]
    assert f"no job registered; rank 1: {why}" in errors[0]
    assert r.zcard(keys.JOBS_INDEX) == 0


def test_a_rank_the_coordinator_refuses_fails_every_rank_at_once(service, redis_url, tmp_path):
    # Rank 1's dp_rank does not fit the job (a launcher that numbered it wrong, with degrees
    # that fit its own numbering, so the hook's own checks pass): the coordinator refuses its
    # registration. Rank 0 had registered and waited for a schedule that never came (all
    # ranks must register first) and then blamed the workers; given a schedule, it would have
    # trained into a collective rank 1 never joins.
    misnumbered = {"dp_rank": 1, "pp_rank": 0, "dp_degree": 2, "pp_degree": 1}
    errors = run_two_ranks(
        redis_url,
        tmp_path,
        "refused",
        {0: {"schedule_timeout": 30}, 1: misnumbered | {"schedule_timeout": 30}},
    )
    why = "ProtocolError: coordinator rejected register_rank: dp_rank=1 is out of range for job"
    assert why in errors[1]
    assert "not every rank joined; rank 1: " + why in errors[0]


def test_a_rank_without_its_first_schedule_fails_every_rank_at_once(
    service, r, redis_url, tmp_path
):
    # Version 1 reaches Redis with rank 0's schedule only (a scheduler that served one rank,
    # a key lost): rank 1 cannot read its schedule and raises. Rank 0 had its schedule and
    # trained on into the step's barrier, where rank 1 never came.
    procs = spawn_ranks(2, 2, redis_url, tmp_path, "one-schedule", 1, 2, pg_timeout_s=PG_TIMEOUT_S)
    store = JobStore(r)
    job_id = wait_for(lambda: next(iter(store.list_jobs()), ("", 0.0))[0], 60, "the job")
    wait_for(lambda: store.rank_count(job_id) == 2, 60, "both ranks registered")
    order = one_f_one_b_order(2, 2, 0)  # what rank 0 runs
    only_rank_0 = [FrequencySchedule(rank=0, frequencies=[(n, 1980) for n in order])]
    assert store.publish(job_id, only_rank_0, JournalEntry(version=1))
    join_ranks(procs, 120)
    errors = [
        json.loads((tmp_path / f"one-schedule-rank{k}.json").read_text()).get("error", "")
        for k in range(2)
    ]
    why = f"ProtocolError: job {job_id} has no schedule version 1 for rank 1"
    assert why in errors[1]
    assert "not every rank got its schedule; rank 1: " + why in errors[0]


def run_two_stages(
    redis_url: str, out: Path, schedule: str, per_rank: list[dict[str, Any]]
) -> list[str]:
    """Two ranks wrap a two-stage ``schedule`` (tests/pipelining_ranks.py); their errors."""
    ctx = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{free_ports()[0]}"
    procs = [
        ctx.Process(
            target=start_rank,
            args=(PipelineRank(rank, 2, init, redis_url, schedule, 2, str(out)),),
            kwargs={"pg_timeout_s": PG_TIMEOUT_S, **kw},
        )
        for rank, kw in enumerate(per_rank)
    ]
    for p in procs:
        p.start()
    join_ranks(procs, 120)
    return [str(json.loads((out / f"rank{k}.json").read_text()).get("error", "")) for k in (0, 1)]


def test_a_stage_whose_schedule_cannot_be_wrapped_fails_every_stage(r, redis_url, tmp_path):
    # The script gave loss_fn to the last stage's schedule only: stage 0 refused to wrap its
    # schedule before its hook existed, and stage 1 waited in its hook's first collective.
    errors = run_two_stages(redis_url, tmp_path, "1f1b", [{"loss": False}, {}])
    why = "ConfigError: Schedule1F1B has no loss_fn"
    assert why in errors[0]
    assert "no job registered; rank 0: " + why in errors[1]
    assert r.zcard(keys.JOBS_INDEX) == 0


def test_a_plan_one_stage_cannot_run_fails_every_stage(hook_service, redis_url, tmp_path):
    # A GPipe plan for a Schedule1F1B: with 2 stages and 2 microbatches stage 0 runs the same
    # order either way, stage 1 does not. Stage 1 refused its plan; stage 0 went on into the
    # pipeline's first step, sending to a stage that was gone.
    _coord, start_worker = hook_service
    start_worker()
    stages = [[(n, 1980) for n, _ in stage_actions("gpipe", 2, 2, s)] for s in range(2)]
    write_plan_file(tmp_path / "plan.py", stages, {"pipeline_schedule": "gpipe"})
    job = {
        "scheduler": "PointSolution",
        "scheduler_args": {"plan_text": (tmp_path / "plan.py").read_text()},
    }
    errors = run_two_stages(redis_url, tmp_path, "1f1b", [{"hook_options": job}] * 2)
    why = "ScheduleError: rank 1 (stage 1): schedule version 1 from the coordinator runs"
    assert why in errors[1] and "in gpipe order, but Schedule1F1B runs" in errors[1]
    assert "no PerseusPipeline created; rank 1: " + why in errors[0]


def test_a_simulated_rank_without_its_gpu_fails_every_rank_at_once(r, redis_url):
    # Two simulated ranks on one simulated GPU: rank 1 could not open GPU 1 before its hook
    # existed, and rank 0 waited in its hook's first collective until the launcher gave up.
    with pytest.raises(RuntimeError) as failed:
        launch_simulated_job(
            2, 2, 1, synthetic_instruction_table(2), redis_url, steps=1, time_scale=0.0,
            sim_gpu_count=1, timeout=60,
        )  # fmt: skip
    why = "ValueError: no simulated GPU 1 (PERSEUS_SIM_GPU_COUNT=1)"
    rank_0, rank_1 = str(failed.value).split("\nrank 1:\n")
    assert f"no job registered; rank 1: {why}" in rank_0
    assert why in rank_1
    assert r.zcard(keys.JOBS_INDEX) == 0
