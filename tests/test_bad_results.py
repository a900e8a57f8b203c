"""Results a rank's scheduler could not use are dead-lettered at the coordinator, not fatal.

Each test sends, signed with the rank's own token, a result that passed the coordinator's
checks before and then failed the job for good in the worker, followed in the same batch by the
rank's good result for the same version. The bad one must be dead-lettered with a reason naming
what is wrong, and the good one taken: the job advances and records no error.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import redis

from coordinator.service import Coordinator
from coordinator.tasks import advance_job
from protocol import keys
from protocol.deadletter import list_dead_letters
from protocol.exceptions import ProtocolError
from protocol.models import ProfilingResult, ReportResult, encode_message
from protocol.store import JobStore
from protocol.tokens import sign
from tests.helpers import (
    RANKS,
    TOY_SCHEDULER,
    drain_until,
    make_settings,
    new_job,
    register,
    result,
    running,
    wait_for,
)
from worker_client.hook.session import CoordinatorClient


@pytest.fixture
def profiler_job(
    r: redis.Redis, redis_url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[CoordinatorClient, str]]:
    """A one-rank InstructionProfiler job (2 microbatches) at version 1, with its coordinator."""
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "simgpu"))
    args = {"microbatches": 2, "warmup_iters": 1}
    coord = Coordinator(r, make_settings(redis_url, "InstructionProfiler", scheduler_args=args))
    with running(coord):
        client = CoordinatorClient(redis_url, reply_timeout=20)
        try:
            job_id = register(client, pp=1)
            drain_until(r, job_id, 1)
            yield client, job_id
        finally:
            client.close()


def good_result() -> ProfilingResult:
    """Rank 0's usable result of version 1: 2 iterations (1 warm-up) of 2 microbatches."""
    times = {"forward": [[0.1, 0.1]] * 2, "backward": [[0.2, 0.2]] * 2}
    energies = {"forward": [[1.0, 1.0]] * 2, "backward": [[2.0, 2.0]] * 2}
    return ProfilingResult(
        rank=0,
        schedule_version=1,
        iter_time=[0.6, 0.6],
        iter_energy=[6.0, 6.0],
        time_breakdown=times,
        energy_breakdown=energies,
    )


def send_bad_then_good(
    r: redis.Redis, client: CoordinatorClient, job_id: str, bad: dict[str, Any]
) -> None:
    """XADD ``bad`` (a raw result dict, signed) and then the good result, in one round trip."""
    token = client.token(job_id, 0)
    assert token
    data = msgpack.packb({"kind": "report_result", "job_id": job_id, "result": bad})
    fields = {"kind": "report_result", "job_id": job_id, "data": data, "mac": sign(token, data)}
    good = encode_message(ReportResult(job_id=job_id, result=good_result()), token=token)
    with r.pipeline(transaction=True) as pipe:
        pipe.xadd(keys.RESULTS_STREAM, fields)
        pipe.xadd(keys.RESULTS_STREAM, good)
        pipe.execute()


def assert_dead_lettered_and_advanced(r: redis.Redis, job_id: str, *named: str) -> None:
    letters = wait_for(lambda: list_dead_letters(r), 10, "the bad result dead-lettered")
    assert len(letters) == 1, [letter.reason for letter in letters]
    for text in named:
        assert text in letters[0].reason, letters[0].reason
    drain_until(r, job_id, 2)
    store = JobStore(r)
    assert store.job_error(job_id) == ""
    assert store.summaries(job_id)[1]["iter_time"] == pytest.approx(0.6)


def test_numbers_sent_as_strings_are_dead_lettered_not_stored(r, profiler_job):
    """Validated laxly, "0.1" passed as a time and was stored as sent; the worker reads stored
    results unvalidated, so the profiler got strings: TypeError, and the job failed."""
    client, job_id = profiler_job
    bad = good_result().model_dump()
    bad["iter_time"] = ["0.6", "0.6"]
    bad["time_breakdown"] = {"forward": [["0.1", "0.1"]] * 2, "backward": [["0.2", "0.2"]] * 2}
    bad["schedule_version"] = "1"
    send_bad_then_good(r, client, job_id, bad)
    assert_dead_lettered_and_advanced(
        r,
        job_id,
        "report_result.result.schedule_version",
        "report_result.result.iter_time.0",
        "report_result.result.time_breakdown.forward.0.0",
    )


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            {"time_breakdown": {"forward": [[0.1]] * 2, "backward": [[0.2]] * 2}},
            "time_breakdown['forward'][0] has 1 times; expected 2",
        ),
        (
            {"iter_time": [0.6], "iter_energy": [6.0]}
            | {"time_breakdown": {"forward": [[0.1, 0.1]], "backward": [[0.2, 0.2]]}},
            "time_breakdown['forward'] has 1 iteration(s), all of them warm-up (warmup_iters=1)",
        ),
    ],
    ids=["one forward time where the job has 2 microbatches", "only warm-up iterations"],
)
def test_a_result_of_the_wrong_shape_for_the_jobs_arguments_is_dead_lettered(
    r, profiler_job, change, named
):
    """Only the scheduler's arguments say how many instructions an iteration has and how many
    iterations are warm-up: such a result passed the coordinator and failed the job."""
    client, job_id = profiler_job
    bad = good_result().model_dump() | change
    # Energies shaped like the times, so that only the count against the arguments is wrong.
    bad["energy_breakdown"] = {
        name: [[1.0] * len(it) for it in iterations]
        for name, iterations in bad["time_breakdown"].items()
    }
    send_bad_then_good(r, client, job_id, bad)
    assert_dead_lettered_and_advanced(r, job_id, named)


def test_a_different_second_result_of_a_rank_is_refused_and_the_first_stays(r):
    """HSETNX kept the first result and dropped a different second one without a word; the
    same entry delivered again (the same bytes) is still taken as a no-op."""
    store = JobStore(r)
    new_job(store, "twice", TOY_SCHEDULER)
    advance_job("twice", conn=r)  # version 1
    info = store.get_job("twice").info
    first = result(0, 1)
    assert store.add_result(info, first)[0] is True
    assert store.add_result(info, first)[0] is False  # redelivered: no error, nothing changed
    other = first.model_copy(update={"iter_time": [1.5]})
    with pytest.raises(ProtocolError, match="already reported a different result for schedule"):
        store.add_result(info, other)
    assert [res.iter_time for res in store.results("twice", 1)] == [[1.0]]


def test_one_batch_keeps_each_ranks_first_result_and_names_each_refusal(r):
    """The results of one batch are stored by one script call: a rank twice in it keeps its
    first result (the same bytes again: a no-op; others refused), an unregistered rank is
    refused, and the rest are stored."""
    store = JobStore(r)
    new_job(store, "batched", TOY_SCHEDULER)
    advance_job("batched", conn=r)  # version 1
    job = store.get_job("batched").info
    # A rank the job does not know (the coordinator refuses its entry before, by its MAC).
    r.hdel(keys.job_ranks("batched"), str(RANKS - 1))
    first = result(0, 1)
    batch = store.batch()
    for res in (
        first,
        result(1, 1),
        first,
        first.model_copy(update={"iter_time": [1.5]}),
        result(RANKS - 1, 1),
    ):
        batch.add_result(job, res, now=1.0)
    outcomes = batch.execute()
    assert [o[0] if isinstance(o, tuple) else str(o) for o in outcomes] == [
        True,
        True,
        False,
        "rank 0 already reported a different result for schedule version 1 of job batched; "
        "the first one stays",
        f"rank {RANKS - 1} is not registered with job batched",
    ]
    assert {res.rank: res.iter_time for res in store.results("batched", 1)} == {
        0: [1.0],
        1: [1.0],
    }
