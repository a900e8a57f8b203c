"""A rank that fails while the ranks start fails every rank at once, naming it and why (gloo)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from protocol import keys
from protocol.models import FrequencySchedule, JournalEntry
from protocol.store import JobStore
from schedulers.planning.pipeline_dag import one_f_one_b_order
from tests.helpers import join_ranks, spawn_ranks, wait_for

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
        ({"report_every": 0}, "ValueError: report_every must be >= 1, got 0"),
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
    # Rank 1's dp_rank does not fit the job (a launcher that numbered it wrong): the
    # coordinator refuses its registration. Rank 0 had registered and waited for a schedule
    # that never came (all ranks must register first) and then blamed the workers; given a
    # schedule, it would have trained into a collective rank 1 never joins.
    errors = run_two_ranks(
        redis_url,
        tmp_path,
        "refused",
        {0: {"schedule_timeout": 30}, 1: {"dp_rank": 1, "schedule_timeout": 30}},
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
