"""What a client (a training rank) may ask of the coordinator: data, never server paths."""

from __future__ import annotations

import math

import msgpack
import pytest
from pydantic import ValidationError

from protocol.exceptions import ProtocolError
from protocol.models import JobInfo, ProfilingResult, unpack
from schedulers.planning.plan_file import write_plan_file
from worker_client.hook.session import CoordinatorClient

JOB = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)


@pytest.mark.parametrize(
    ("scheduler", "args", "named"),
    [
        ("PointSolution", {"solution_path": "/etc/passwd"}, "solution_path"),
        ("PointSolution3D", {"solution_path": "/etc/hostname"}, "solution_path"),
        ("FrontierScheduler", {"frontier_dir": "/proc/self"}, "frontier_dir"),
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
