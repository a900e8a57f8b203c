"""Thousands of ranks or versions: nothing breaks (Lua's unpack limit), nor costs ranks x ranks."""

from __future__ import annotations

import re

import pytest

from coordinator.dump import dump_job
from coordinator.status import snapshot
from coordinator.tasks import advance_job
from coordinator.trust import ResultKeys
from protocol import keys
from protocol.exceptions import ProtocolError
from protocol.job_lifecycle import JobLifecycle
from protocol.models import JobInfo, JournalEntry, RankInfo
from protocol.store import JobStore
from protocol.store_worker import DRAFT_CHUNK
from tests.helpers import TOY_SCHEDULER, new_job, report_all, result, wide_job

# Lua's unpack takes about 8000 values: a version's schedules are two per rank.
WORLD = 4500


def _wide_job(
    store: JobStore, job_id: str, world: int = WORLD, scheduler: str = TOY_SCHEDULER
) -> JobInfo:
    """A ``world``-rank job, every rank registered (rank r's token is ``t<r>``)."""
    return wide_job(store, job_id, world, scheduler)


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


def test_status_of_a_stalled_job_waits_on_each_of_thousands_of_closed_ranks(r):
    """Each closed rank was looked up in the list of silent ones: quadratic, 20,000 silent
    ranks that closed without reporting took `perseus status` 1.3 s (0.36 s at 10,000, 2.9 s
    at 30,000, about a minute at max_world_size's 100,000); with sets 0.1 s at 20,000 (h10,
    2026-11-29). No time is asserted here (a loaded machine varies more than that): the
    state must come out the same."""
    world = 5000
    store = JobStore(r)
    _wide_job(store, "stuck", world)
    assert advance_job("stuck", conn=r) == [1]
    lifecycle = JobLifecycle(store)
    for rank in range(world - 1):  # the last one still runs: the job is not finished
        lifecycle.finish_rank("stuck", rank, f"t{rank}")
    store.add_result(store.get_job("stuck").info, result(world - 1, 1))
    (job,) = snapshot(r, silent_after=0.0)["jobs"]
    assert job["state"] == "stalled" and job["waiting_on"] == list(range(world - 1))
    assert len(job["closed_ranks"]) == world - 1


def test_a_scheduler_that_loses_one_of_thousands_of_ranks_fails_the_job_in_a_line(r):
    """The error listed every rank returned and expected: 5,000 ranks made a 50 kB error
    (1.2 MB at 100,000), stored on the job and sent on its updates stream to every rank's
    watcher. It names the ranks missing (and extra or twice), a few at most."""
    store = JobStore(r)
    _wide_job(store, "lossy", 5000, "tests.toy_schedulers:DropsLastRank")
    with pytest.raises(ProtocolError, match=r"missing ranks \[4999\]$"):
        advance_job("lossy", conn=r)
    error = store.job_error("lossy")
    assert error.endswith("5000 ranks: missing ranks [4999]") and len(error) < 500, error[:500]


def test_a_scheduler_saves_thousands_of_artifacts(r):
    """A scheduler may leave one artifact per rank (its API takes any number): over about
    4000 the script that saves them failed ('too many results to unpack'), every time."""
    store = JobStore(r)
    new_job(store, "many", TOY_SCHEDULER)
    artifacts = {f"stage-{rank}.csv": b"x" for rank in range(WORLD)}
    store.save_artifacts("many", artifacts)
    assert store.artifacts("many") == artifacts


def test_a_result_of_an_unregistered_rank_does_not_read_every_ranks_key_again(r):
    """The coordinator caches a job's result keys; a rank it lacks was looked up by reading
    the keys of every rank of the job again (HGETALL), at each batch with such a result:
    55 ms a batch at 50,000 ranks (13.5 at 10,000), against 0.3 for a valid result."""
    store = JobStore(r)
    _wide_job(store, "wide")
    cache = ResultKeys(store)
    cache.load([("wide", 0)])
    r.config_resetstat()
    for _ in range(3):
        cache.load([("wide", WORLD + 5), ("wide", 1)])
    stats = r.info("commandstats")
    assert "cmdstat_hgetall" not in stats, stats["cmdstat_hgetall"]
    assert cache._jobs["wide"][1] and WORLD + 5 not in cache._jobs["wide"]


class _RanksCounted(JobStore):
    """A store that counts its reads of a job's ranks."""

    ranks_read = 0

    def ranks(self, job_id: str) -> list[RankInfo]:
        self.ranks_read += 1
        return super().ranks(job_id)


def test_a_dump_reads_and_writes_the_ranks_once_whatever_the_versions(r, tmp_path):
    """perseus dump wrote ranks.json again with each version (V + 1 times): 5,000 ranks of
    120 clocks, 8 versions: 5.2 s (2 versions: 1.4 s); now 2.6 s (0.8 s)."""
    store = _RanksCounted(r)
    new_job(store, "long", TOY_SCHEDULER)
    for version in range(1, 6):
        assert advance_job("long", conn=r) == [version]
        report_all(store, "long")
    dump = dump_job(store, "long", str(tmp_path))
    assert store.ranks_read == 1
    assert len(list(dump.folder.glob("*.sched.json"))) == 4  # the oldest is not kept
    assert len(list(dump.folder.glob("*.prof.json"))) == 5


def _longest_command(r, name: bytes, key: str | None = None) -> int:
    """Most arguments of a ``name`` command (on ``key``) in the slow log (it keeps 32, counts
    the rest); 0 if none ran."""
    longest = 0
    # Raw entries: [id, time, duration, [arguments...], ...] (no parsing into one string).
    for entry in r.execute_command("SLOWLOG", "GET", 100_000, NEVER_DECODE=True):
        words = entry[3]
        if words[0].upper() != name or (key is not None and words[1] != key.encode()):
            continue
        more = re.fullmatch(rb"\.\.\. \((\d+) more arguments\)", words[-1])
        longest = max(longest, len(words) - 1 + int(more.group(1)) if more else len(words))
    return longest


def test_thousands_of_schedules_are_written_in_chunks_not_one_script_call(r):
    """The publish script took every rank's schedule as its arguments: one call blocked Redis
    for 316 ms at 100,000 ranks (every other client waited). A wide version is drafted in
    chunks first and the script only renames the draft: the same schedules, no draft left."""
    store = JobStore(r)
    _wide_job(store, "wide")
    r.config_set("slowlog-max-len", 100_000)
    r.config_set("slowlog-log-slower-than", 0)
    try:
        r.slowlog_reset()
        assert advance_job("wide", conn=r) == [1]
        assert 0 < _longest_command(r, b"EVALSHA") < 64
        assert 0 < _longest_command(r, b"HSET") <= 2 + 2 * DRAFT_CHUNK
        # Nor one read of every rank's info (HVALS: 50-96 ms at 100,000 ranks).
        ranks = keys.job_ranks("wide")
        assert not _longest_command(r, b"HVALS", ranks) and _longest_command(r, b"HSCAN", ranks)
    finally:
        r.config_set("slowlog-log-slower-than", 10_000)
    schedules = store.schedules("wide", 1)
    assert [s.rank for s in schedules] == list(range(WORLD))
    assert all(s.version == 1 for s in schedules)
    assert not list(r.scan_iter(match="*draft*"))


def test_a_draft_that_lost_the_race_or_expired_publishes_nothing(r):
    """A worker whose version another published first leaves no draft behind; one whose
    draft is gone (expired) publishes nothing and says so (the job stays due)."""
    store = JobStore(r)
    _wide_job(store, "race")
    assert advance_job("race", conn=r) == [1]
    schedules = store.schedules("race", 1)
    entry = JournalEntry(version=1)  # version 1 again: another worker published it first
    assert not store.publish("race", schedules, entry)
    assert store.version("race") == 1
    assert not list(r.scan_iter(match="*draft*"))
    gone = keys.job_schedule_draft("race", 2, "expired")
    status, current = store.scripts.publish(
        keys=[
            keys.job_version("race"),
            keys.job_schedule("race", 2),
            keys.job_journal("race"),
            keys.job_updates("race"),
            keys.JOBS_INDEX,
            keys.job_info("race"),
            keys.job_summaries("race"),
            keys.job_schedule("race", 0),
            gone,
        ],
        args=["race", 2.0, 1, 2, b"", 100, "", "", "", "0"],
    )
    assert (status, current) == (-2, 1)
    assert store.version("race") == 1 and not r.exists(keys.job_schedule("race", 2))
