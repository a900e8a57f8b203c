"""Thousands of ranks or versions: no script hands Lua's unpack more values than it takes."""

from __future__ import annotations

from coordinator.tasks import advance_job
from protocol import keys
from protocol.models import JobConfig, JobInfo, RankInfo
from protocol.store import JobStore
from protocol.tokens import credentials
from tests.helpers import TOY_SCHEDULER, new_job, result

# Lua's unpack takes about 8000 values: a version's schedules are two per rank.
WORLD = 4500


def _wide_job(store: JobStore, job_id: str) -> JobInfo:
    """A ``WORLD``-rank job, every rank registered (one script call each, one round trip)."""
    job = JobInfo(job_id=job_id, pp_degree=WORLD, dp_degree=1, tp_degree=1, world_size=WORLD)
    store.create_job(job, JobConfig(scheduler=TOY_SCHEDULER), "1-0")
    batch = store.batch()
    for rank in range(WORLD):
        info = RankInfo(rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=[1980])
        batch.add_rank(
            job, info, now=1.0, credentials=credentials(f"t{rank}"), request_id=str(rank)
        )
    assert batch.execute() == list(range(1, WORLD + 1))
    return job


def test_a_job_of_thousands_of_ranks_publishes_and_stores_a_batch_of_all_their_results(r):
    """Its first version failed to publish ('too many results to unpack'): every job of more
    than about 4000 ranks (max_world_size allows 100,000) never got a schedule."""
    store = JobStore(r)
    job = _wide_job(store, "wide")
    assert advance_job("wide", conn=r) == [1]
    assert r.hlen(keys.job_schedule("wide", 1)) == WORLD
    batch = store.batch()
    for rank in range(WORLD):
        batch.add_result(job, result(rank, 1), now=2.0)
    assert [o[:2] for o in batch.execute()] == [(True, 1)] * WORLD
    assert len(store.results("wide", 1)) == WORLD


def test_a_snapshot_deletes_the_results_of_thousands_of_versions(r):
    """A snapshot deletes the results it consumed, one key per version: with snapshot_every
    (no upper bound) over about 8000 it failed, and results were kept for ever."""
    store = JobStore(r)
    new_job(store, "deep", TOY_SCHEDULER)
    advance_job("deep", conn=r)  # version 1: the journal's first entry
    store.add_result(store.get_job("deep").info, result(0, 1))
    assert store.save_snapshot("deep", b"state", 1, range(1, 9000))
    assert not r.exists(keys.job_results("deep", 1))
