"""A job's keys overwritten with garbage (on Redis 6.2 ranks may SET the keys they read).

Whatever one job's keys hold, the coordinator's sweep goes on and deletes what is due,
`perseus status` and `perseus jobs list` name the job as unreadable and show the others, and
deleting a job removes its keys however many versions it had.
"""

from __future__ import annotations

import json
import logging

import pytest
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.service import Coordinator
from protocol import keys
from protocol.exceptions import ProtocolError
from protocol.models import FrequencySchedule, JobConfig, JobInfo, JournalEntry
from protocol.store import JobStore
from tests.helpers import TOY_SCHEDULER, age_job, make_settings


def make_job(store: JobStore, job_id: str, versions: int = 1) -> None:
    info = JobInfo(job_id=job_id, pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    store.create_job(info, JobConfig(scheduler=TOY_SCHEDULER), "1-0")
    for version in range(1, versions + 1):
        schedule = FrequencySchedule(rank=0, frequencies=[("forward", 1980)])
        assert store.publish(job_id, [schedule], JournalEntry(version=version))


def job_keys(r, job_id: str) -> list[bytes]:
    return list(r.scan_iter(match=f"perseus:job:{job_id}:*", count=1000))


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda r, j: r.set(keys.job_version(j), "notanint"),
        lambda r, j: r.set(keys.job_version(j), "99999999999999999999"),
        lambda r, j: (r.delete(keys.job_version(j)), r.hset(keys.job_version(j), "x", "1")),
        lambda r, j: (r.delete(keys.job_info(j)), r.set(keys.job_info(j), "garbage")),
        lambda r, j: r.hset(keys.job_info(j), "world_size", "abc"),
        lambda r, j: r.hdel(keys.job_info(j), "job_id"),
    ],
    ids=["version-text", "version-huge", "version-hash", "info-string", "info-field", "info-id"],
)
def test_a_corrupt_job_stops_neither_the_sweep_nor_status_nor_jobs_list(
    r, redis_url, caplog, corrupt
):
    store = JobStore(r)
    make_job(store, "bad", versions=3)
    make_job(store, "good")
    age_job(r, "bad", 3600)
    age_job(r, "good", 3600)
    corrupt(r, "bad")
    # Both listed: status and jobs list name the bad one and show the good one.
    status = CliRunner().invoke(main, ["status", "--redis-url", redis_url])
    assert status.exit_code == 0, status.output
    assert "jobs: 1 (+1 unreadable)" in status.output
    assert "bad  UNREADABLE: " in status.output and "good" in status.output
    listed = CliRunner().invoke(main, ["jobs", "list", "--redis-url", redis_url, "--json"])
    assert listed.exit_code == 0, listed.output
    rows = {row["job_id"]: row for row in json.loads(listed.output)}
    assert rows["bad"]["state"] == "unreadable" and rows["bad"]["error"]
    assert rows["good"]["state"] == "running"
    # Idle: the sweep deletes both, the bad one with every key of its versions.
    coord = Coordinator(r, make_settings(redis_url, max_job_idle_time=60))
    with caplog.at_level(logging.ERROR):
        coord.sweep()
    assert job_keys(r, "bad") == [] and job_keys(r, "good") == []
    assert r.zscore(keys.JOBS_INDEX, "bad") is None


def test_a_garbage_version_is_named_not_a_valueerror(r):
    r.set(keys.job_version("j"), "12abc")
    with pytest.raises(ProtocolError, match="version key holds b'12abc'"):
        JobStore(r).version("j")


def test_a_job_of_thousands_of_versions_is_deleted(r):
    # DEL took every key in one unpack(), which Lua refuses past about 8,000 values.
    store = JobStore(r)
    make_job(store, "long", versions=1)
    r.set(keys.job_version("long"), 5000)
    r.hset(keys.job_results("long", 4321), "0", "x")
    assert store.delete_job("long")
    assert job_keys(r, "long") == []


def test_a_scan_for_a_jobs_versions_leaves_other_jobs_alone(r):
    # A job id in the index is anyone's on Redis 6.2: glob characters and a look-alike prefix.
    store = JobStore(r)
    make_job(store, "a:schedule")
    make_job(store, "a*")
    make_job(store, "a")
    r.set(keys.job_version("a"), "garbage")
    assert store.delete_job("a")
    own = [keys.job_info("a"), keys.job_version("a"), keys.job_schedule("a", 1)]
    assert r.exists(*own) == 0
    assert store.version("a:schedule") == 1 and store.version("a*") == 1
    assert r.exists(keys.job_schedule("a:schedule", 1), keys.job_schedule("a*", 1)) == 2
