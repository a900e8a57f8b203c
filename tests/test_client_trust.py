"""What a client (a training rank) may ask of the coordinator: data, never server paths."""

from __future__ import annotations

import math

import msgpack
import pytest
from pydantic import ValidationError

from protocol import keys
from protocol.constants import MAX_CLOCK_MHZ, MAX_RANK_CLOCKS
from protocol.deadletter import list_dead_letters
from protocol.exceptions import ProtocolError
from protocol.models import (
    JobInfo,
    ProfilingResult,
    RankInfo,
    RegisterJob,
    Reply,
    decode_message,
    encode_message,
    unpack,
    validate,
)
from protocol.store import JobStore
from schedulers.planning.plan_file import write_plan_file
from tests.helpers import drain, register, result, wait_for
from worker_client.hook.session import CoordinatorClient

JOB = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)


@pytest.mark.parametrize(
    ("scheduler", "args", "named"),
    [
        ("PointSolution", {"solution_path": "/etc/passwd"}, "solution_path"),
        ("PointSolution3D", {"solution_path": "/etc/hostname"}, "solution_path"),
        ("FrontierScheduler", {"frontier_dir": "/proc/self"}, "frontier_dir"),
        ("FrontierScheduler", {"profile": "/etc/hostname", "microbatches": 2}, "profile"),
        ("InstructionProfiler", {"microbatches": 2, "out_path": "../x.csv"}, "out_path"),
        ("InstructionProfiler", {"microbatches": 2, "then": {"out_dir": "/tmp/x"}}, "then"),
    ],
)
def test_a_job_cannot_name_server_paths(service, redis_url, tmp_path, scheduler, args, named):
    client = CoordinatorClient(redis_url, reply_timeout=10)
    with pytest.raises(ProtocolError) as caught:
        client.register_job(JOB, scheduler, args)
    message = str(caught.value)
    assert f"{named} of {scheduler} name paths on the server" in message
    # Nothing about the path itself: not whether it exists, not its contents.
    for value in args.values():
        if isinstance(value, str):
            assert value not in message
    assert not (tmp_path.parent / "x.csv").exists()


def test_a_job_may_send_its_plan_as_data(service, redis_url, tmp_path):
    plan = tmp_path / "freqs_pipeline_00000.py"
    write_plan_file(plan, [[("forward", 1980), ("backward", 1980)]], {"plan": 0})
    client = CoordinatorClient(redis_url, reply_timeout=10)
    args = {"plan_text": plan.read_text(), "solution_path": None}
    assert client.register_job(JOB, "PointSolution", args).endswith("+PointSolution")


@pytest.mark.parametrize("metadata", ["bert\n", "a" * 64 + "\n"])
def test_job_metadata_with_a_trailing_line_break_is_refused(service, r, redis_url, metadata):
    """1-64 letters, digits, '.', '_' or '-': a regex's ``$`` also matched before a final newline.

    The tag goes into the job id and every key name of the job.
    """
    with pytest.raises(ValidationError, match="job_metadata"):
        JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1, job_metadata=metadata)
    # A client that skips the check: the coordinator refuses it, and no job is created.
    sneaky = JobInfo.model_construct(**(JOB.model_dump() | {"job_metadata": metadata}))
    request = RegisterJob.model_construct(request_id="sneaky", job=sneaky, scheduler_args={})
    r.xadd(keys.REGISTRATIONS_STREAM, encode_message(request, wait_s=10.0))
    answer = r.blpop([keys.reply_key("sneaky")], timeout=10)
    assert answer is not None, "no reply to the registration"
    reply = unpack(Reply, answer[1])
    assert not reply.ok and "job_metadata" in reply.error
    assert r.zcard(keys.JOBS_INDEX) == 0
    assert not list(r.scan_iter(match=f"{keys.PREFIX}:job:*"))


MEASURED = ("iter_time", "iter_energy", "time_breakdown", "energy_breakdown")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0])
@pytest.mark.parametrize(
    "where", ["iter_time", "iter_energy", "time_breakdown", "energy_breakdown"]
)
def test_results_hold_finite_non_negative_numbers_only(bad, where):
    fields: dict = {"rank": 0, "iter_time": [1.0], "iter_energy": [2.0]}
    if where.endswith("breakdown"):
        fields[where] = {"forward": [[0.1, bad]]}
    else:
        fields[where] = [bad]
    with pytest.raises(ValidationError, match=where):
        ProfilingResult(**fields)
    # Also when it arrives as a stream entry: decoding names the field.
    good = ProfilingResult(rank=0, iter_time=[1.0], iter_energy=[2.0])
    raw = msgpack.packb({**good.model_dump(), **{k: v for k, v in fields.items() if k == where}})
    with pytest.raises(ProtocolError, match=where):
        unpack(ProfilingResult, raw)


def test_an_oversize_entry_is_dead_lettered_with_its_head_and_size_only(service, r, redis_url):
    client = CoordinatorClient(redis_url)
    job_id = register(client, pp=1)
    drain(r)
    big = {"kind": "report_result", "job_id": job_id, "data": b"\x00" * (8 * 1024 * 1024)}
    r.xadd(keys.RESULTS_STREAM, big)
    (letter,) = wait_for(lambda: list_dead_letters(r), 10, "the oversize entry's dead letter")
    assert "over max_entry_bytes=1048576 (PERSEUS_MAX_ENTRY_BYTES)" in letter.reason
    assert letter.size is not None and letter.size > 8 * 1024 * 1024
    assert len(letter.original[b"data"]) == 256 and not letter.replayable
    # Only the head was copied, and nothing else was lost: a good result still goes through.
    assert r.memory_usage(keys.DEADLETTER_STREAM) < 64 * 1024
    client.report(job_id, result(0, 1))
    wait_for(lambda: JobStore(r).result_count(job_id, 1) == 1, 10, "the good result")


def test_huge_counts_are_refused_at_registration(service, redis_url):
    client = CoordinatorClient(redis_url, reply_timeout=10)
    huge = JobInfo(pp_degree=10**9, dp_degree=1, tp_degree=1, world_size=10**9)
    with pytest.raises(ProtocolError, match="world_size 1000000000 is over max_world_size"):
        client.register_job(huge)
    job_id = client.register_job(JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1))
    rank = RankInfo(
        rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=list(range(1, 5001))
    )
    with pytest.raises(ProtocolError, match="5000 frequencies, over max_frequencies=1024"):
        client.register_rank(job_id, rank)


@pytest.mark.parametrize(
    ("clocks", "words"),
    [
        # Ten million clocks were read, checked one by one and deduplicated first.
        (list(range(1, MAX_RANK_CLOCKS + 2)), f"should have at most {MAX_RANK_CLOCKS} items"),
        # A clock of 10**15 MHz was swept, and failed the planner after the sweep.
        ([1980, 10**15], "available_frequencies.1: Input should be less than or equal to"),
    ],
)
def test_a_ranks_clock_list_is_bounded_whatever_the_settings(clocks, words):
    rank = {"rank": 0, "dp_rank": 0, "pp_rank": 0, "tp_rank": 0, "available_frequencies": clocks}
    raw = {"kind": "register_rank", "request_id": "r1", "job_id": "j", "rank_info": rank}
    with pytest.raises(ProtocolError, match=r"rank_info\.available_frequencies") as info:
        decode_message({b"data": msgpack.packb(raw)})
    assert words in str(info.value)
    rank["available_frequencies"] = list(range(MAX_CLOCK_MHZ, MAX_CLOCK_MHZ - MAX_RANK_CLOCKS, -1))
    assert len(decode_message({b"data": msgpack.packb(raw)}).rank_info.available_frequencies) == (
        MAX_RANK_CLOCKS
    )


def test_a_check_of_several_fields_reads_as_one_plain_sentence() -> None:
    """Degrees that do not multiply to the world size read "<root>: Value error, world_size=1
    but ..." on every rank (pydantic's prefix, and a field name for no field)."""
    with pytest.raises(ProtocolError) as info:
        validate(JobInfo, {"pp_degree": 2, "dp_degree": 1, "tp_degree": 1, "world_size": 1})
    assert str(info.value) == (
        "invalid JobInfo: world_size=1 but pp_degree*dp_degree*tp_degree = 2*1*1 = 2"
    )
    # A field's own error still names the field, and a value of the wrong shape the root.
    with pytest.raises(ProtocolError, match=r"^invalid JobInfo: pp_degree: Input should be"):
        validate(JobInfo, {"pp_degree": "x", "dp_degree": 1, "tp_degree": 1, "world_size": 1})
    with pytest.raises(ProtocolError, match=r"^invalid JobInfo: <root>: Input should be a valid"):
        validate(JobInfo, [1, 2])
