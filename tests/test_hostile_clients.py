"""Hostile clients next to a genuine job, against a real `perseus coordinator` process.

Each case writes what a buggy or malicious Redis client could (oversize entries, msgpack bombs,
NaN, huge counts, foreign results, server paths, replayed entries). After each: the coordinator
is still running, the bad entry is dead-lettered with a reason naming what is wrong, the
genuine job advances one more version with its own results (nothing valid lost), and Redis
and the coordinator stay within memory bounds.

Bounds, and why these: once the hostile entries are deleted from the input streams (as
stream trimming would), Redis may hold at most ``REDIS_SLACK`` (2 MiB) more than after setup
(measured: under 0.3 MiB). Dead letters keep a few hundred bytes per entry; copying the 4 MiB
entry whole (the old behaviour) would alone break the bound. The coordinator's RSS may grow by
``RSS_SLACK`` (32 MiB) over its steady state (measured: 4 MiB after the 4 MiB entry, 11 MiB
after the 200,000-field one): reading an entry costs a few copies of it in redis-py; decoding
a 10 MB one (the old behaviour) cost 500 MB, and nothing may cost in proportion to a length
that a msgpack header declares. Run with ``-s`` to see the figures of each case.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from coordinator.embedded import EmbeddedRedis
from protocol import keys
from protocol.deadletter import list_dead_letters
from protocol.models import JobInfo, RankInfo, ReportResult, SetTarget, encode_message
from protocol.store import JobStore
from tests.helpers import drain, register, result, start_perseus, stop, wait_for
from worker_client.hook.session import CoordinatorClient

MIB = 1024 * 1024
REDIS_SLACK = 2 * MIB
RSS_SLACK = 32 * MIB
SCHEDULER = "tests.toy_schedulers:SnapshotStepDown"  # snapshots consume old results


@dataclass
class Stack:
    """A coordinator process, a genuine 2-rank job, and a hostile client with its own job."""

    conn: redis.Redis
    coordinator: Any  # subprocess.Popen
    genuine: CoordinatorClient
    job_id: str
    hostile: CoordinatorClient
    hostile_job: str
    profiler_job: str
    first_result: dict[bytes, bytes] = field(default_factory=dict)  # genuine, version 1
    first_registration: dict[bytes, bytes] = field(default_factory=dict)  # genuine rank 0
    redis_base: int = 0
    rss_base: int = 0

    @property
    def version(self) -> int:
        return JobStore(self.conn).version(self.job_id)

    def advance(self) -> int:
        """Both genuine ranks report the current version; return the next one, published."""
        version = self.version
        for rank in (0, 1):
            self.genuine.report(self.job_id, result(rank, version))

        def observed() -> dict[str, Any] | None:
            drain(self.conn)  # the coordinator enqueued the work once both results arrived
            return JobStore(self.conn).summaries(self.job_id).get(version)

        # Results are consumed at once (snapshots): the summary says they were all observed.
        summary = wait_for(observed, 15, f"version {version}'s results observed", poll=0.05)
        assert summary["ranks"] == 2 and summary["iter_time"] == 1.0  # the genuine ones
        assert self.version == version + 1
        return version + 1


def rss(pid: int) -> int:
    """Resident set size of a process, in bytes (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("hostile")
    with EmbeddedRedis() as server:
        conn = redis.Redis.from_url(server.url)
        env = {"PERSEUS_SNAPSHOT_EVERY": "1", "PERSEUS_RECONCILE_INTERVAL": "0.5"}
        args = ["coordinator", "--redis-url", server.url, "--scheduler", SCHEDULER]
        proc = start_perseus(args, tmp, "coordinator.log", env)
        try:
            genuine = CoordinatorClient(server.url, reply_timeout=20)
            # What the genuine client sends, kept for the replays: the coordinator trims
            # acknowledged entries from the streams.
            sent: list[tuple[str, dict[bytes, bytes]]] = []
            # Registrations go over a connection the client keeps, results over its pool.
            for conn_used in (genuine.conn, genuine._registrations()):
                record_xadds(conn_used, sent)
            job_id = register(genuine, pp=2)
            genuine.release_idle()  # as the hook does: the replies read are removed
            hostile = CoordinatorClient(server.url, reply_timeout=20)
            hostile_job = register(hostile, pp=1)
            profiler_job = hostile.register_job(
                JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1),
                "InstructionProfiler",
                {"microbatches": 1},
            )
            stack = Stack(conn, proc, genuine, job_id, hostile, hostile_job, profiler_job)
            drain(conn)
            stack.advance()
            stack.first_result = _entry(sent, keys.RESULTS_STREAM, job_id)
            stack.first_registration = _entry(sent, keys.REGISTRATIONS_STREAM, job_id)
            stack.advance()
            floor = int(conn.hget(keys.job_info(job_id), "results_floor") or 1)
            assert floor > 1  # version 1's results are consumed: a replay of one is late
            stack.redis_base = int(conn.info("memory")["used_memory"])
            stack.rss_base = rss(proc.pid)
            yield stack
        finally:
            stop([proc])
            print((tmp / "coordinator.log").read_text()[-3000:])


def record_xadds(conn: redis.Redis, sent: list[tuple[str, dict[bytes, bytes]]]) -> None:
    """Have every XADD ``conn`` sends appended to ``sent`` (stream, fields) too."""
    xadd = conn.xadd

    def recording_xadd(name: str, fields: dict[Any, Any], *args: Any, **kw: Any) -> Any:
        sent.append((name, {_bytes(k): _bytes(v) for k, v in fields.items()}))
        return xadd(name, fields, *args, **kw)

    conn.xadd = recording_xadd


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _entry(
    sent: list[tuple[str, dict[bytes, bytes]]], stream: str, job_id: str
) -> dict[bytes, bytes]:
    """The first entry sent to ``stream`` about ``job_id``."""
    for name, fields in sent:
        if name == stream and fields.get(b"job_id") == job_id.encode():
            return fields
    raise AssertionError(f"no entry about {job_id} sent to {stream}")


Entries = list[tuple[str, dict[Any, Any]]]


def _raw(stream: str, kind: str, data: bytes, job_id: str = "") -> Entries:
    fields: dict[str, Any] = {"kind": kind, "data": data}
    if job_id:
        fields["job_id"] = job_id
    return [(stream, fields)]


def _result_dict(s: Stack, **changes: Any) -> bytes:
    res = result(0, s.version).model_dump() | changes
    return msgpack.packb({"kind": "report_result", "job_id": s.job_id, "result": res})


def _signed_result(s: Stack) -> dict[str, Any]:
    """Genuine rank 0's result for the current version, signed with its token."""
    message = ReportResult(job_id=s.job_id, result=result(0, s.version))
    return encode_message(message, s.genuine.token(s.job_id, 0))


def _foreign(s: Stack, token: str | None) -> Entries:
    forged = result(0, s.version).model_copy(update={"iter_time": [99.0]})
    return [
        (keys.RESULTS_STREAM, encode_message(ReportResult(job_id=s.job_id, result=forged), token))
    ]


def _register_job(**message: Any) -> bytes:
    job = {"pp_degree": 1, "dp_degree": 1, "tp_degree": 1, "world_size": 1}
    return msgpack.packb({"kind": "register_job", "request_id": "hostile", "job": job} | message)


def _register_rank(job_id: str, clocks: list[int]) -> bytes:
    info = RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=clocks)
    message = {"kind": "register_rank", "request_id": "hostile-rank", "job_id": job_id}
    return msgpack.packb(message | {"rank_info": info.model_dump()})


R, G, C = keys.RESULTS_STREAM, keys.REGISTRATIONS_STREAM, keys.CONTROL_STREAM
CASES: dict[str, tuple[Callable[[Stack], Entries], str]] = {
    "oversize entry": (
        lambda s: _raw(R, "report_result", b"\x00" * (4 * MIB), s.job_id),
        "over max_entry_bytes=1048576",
    ),
    "200,000 tiny fields": (
        lambda s: [(R, {f"f{i}": b"" for i in range(200_000)})],
        "over max_entry_bytes",
    ),
    # Stored as a genuine result; dead-lettered, its replay failed in Lua (unpack's limit).
    "a genuine result with 5,000 more fields": (
        lambda s: [(R, _signed_result(s) | {f"f{i}": b"" for i in range(5_000)})],
        "entry has 5004 fields; at most 64",
    ),
    "deep nesting": (
        lambda s: _raw(R, "report_result", b"\x91" * 100_000 + b"\xc0"),
        "not valid msgpack (StackError: nested too deeply)",
    ),
    "huge declared array": (
        lambda s: _raw(R, "report_result", b"\xdd\xff\xff\xff\xff"),
        "4294967295 exceeds max_array_len",
    ),
    "huge declared map": (
        lambda s: _raw(R, "report_result", b"\xdf\xff\xff\xff\xff"),
        "4294967295 exceeds max_map_len",
    ),
    "ext type": (
        lambda s: _raw(
            R, "report_result", _result_dict(s, iter_time=msgpack.ExtType(5, b"x" * 100))
        ),
        "report_result.result.iter_time",
    ),
    "a byte no msgpack value starts with": (
        lambda s: _raw(R, "report_result", b"\x91\xc1"),
        "not valid msgpack (FormatError: a byte that starts no msgpack value (0xc1))",
    ),
    "garbage": (
        lambda s: _raw(R, "report_result", bytes(range(256)) * 16),
        "not valid msgpack",
    ),
    "NaN": (
        lambda s: _raw(R, "report_result", _result_dict(s, iter_time=[math.nan])),
        "report_result.result.iter_time.0",
    ),
    "infinity": (
        lambda s: _raw(
            R, "report_result", _result_dict(s, time_breakdown={"forward": [[math.inf]]})
        ),
        "report_result.result.time_breakdown.forward.0.0",
    ),
    "world_size 10^9": (
        lambda s: _raw(
            G,
            "register_job",
            _register_job(
                job={"pp_degree": 10**9, "dp_degree": 1, "tp_degree": 1, "world_size": 10**9}
            ),
        ),
        "over max_world_size=100000 (PERSEUS_MAX_WORLD_SIZE)",
    ),
    # It names the reply list's key: perseus:reply:<request id>.
    "request id with a colon and a space": (
        lambda s: _raw(G, "register_job", _register_job(request_id="x:y z")),
        "register_job.request_id: String should match pattern",
    ),
    "5,000 frequencies": (
        lambda s: _raw(G, "register_rank", _register_rank(s.job_id, list(range(1, 5001)))),
        "over max_frequencies=1024 (PERSEUS_MAX_FREQUENCIES)",
    ),
    "a 300-version sweep": (
        lambda s: _raw(G, "register_rank", _register_rank(s.profiler_job, list(range(1, 301)))),
        "300 versions, over max_sweep_versions=256 (PERSEUS_MAX_SWEEP_VERSIONS)",
    ),
    "result without token": (lambda s: _foreign(s, None), "wrong token for rank 0"),
    "result with a made-up token": (lambda s: _foreign(s, "guess"), "wrong token for rank 0"),
    "result with another job's token": (
        lambda s: _foreign(s, s.hostile.token(s.hostile_job, 0)),
        "wrong token for rank 0",
    ),
    "result for a rank outside the job": (
        lambda s: _raw(R, "report_result", _result_dict(s, rank=7), s.job_id),
        "rank 7 is not registered with job",
    ),
    "server path argument": (
        lambda s: _raw(
            G,
            "register_job",
            _register_job(
                scheduler="InstructionProfiler",
                scheduler_args={"microbatches": 1, "out_path": "../x.csv"},
            ),
        ),
        "out_path of InstructionProfiler name paths on the server",
    ),
    "replayed result of a consumed version": (
        lambda s: [(R, s.first_result)],
        "after the scheduler consumed that version's results",
    ),
    "replayed registration": (
        lambda s: [(G, s.first_registration)],
        "was already answered",
    ),
    # A registration dead-lettered off the results stream could be replayed, which
    # registrations never are.
    "registration on the results stream": (
        lambda s: _raw(R, "report_result", _register_job()),
        "a register_job message does not belong on perseus:stream:results",
    ),
    "kind field that says otherwise": (
        lambda s: _raw(R, "register_rank", _result_dict(s), s.job_id),
        "field 'kind' says 'register_rank' but the data's kind is 'report_result'",
    ),
    "job_id field that says otherwise": (
        lambda s: _raw(R, "report_result", _result_dict(s), s.hostile_job),
        "field 'job_id' says",
    ),
    # The reason (and the coordinator's log line) repeated all of it.
    "100,000-character job id": (
        lambda s: _raw(G, "register_rank", _register_rank("j" * 100_000, [1980])),
        "register_rank.job_id: String should have at most 512 characters",
    ),
    # Stored, it made the worker fail the job for good.
    "target for a scheduler that takes none": (
        lambda s: [(C, encode_message(SetTarget(job_id=s.profiler_job, iteration_time=0.5)))],
        "runs InstructionProfiler, which takes no target iteration time",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_entry_is_dead_lettered_and_the_genuine_job_goes_on(stack, case):
    make, reason = CASES[case]
    conn = stack.conn
    seen = {letter.entry_id for letter in list_dead_letters(conn)}
    added = [(stream, conn.xadd(stream, fields)) for stream, fields in make(stack)]

    def new_letters() -> list[str]:
        return [letter.reason for letter in list_dead_letters(conn) if letter.entry_id not in seen]

    letters = wait_for(new_letters, 15, f"the dead letter of {case}")
    assert len(letters) == len(added) and all(reason in text for text in letters), letters
    assert all(len(text) < 2000 for text in letters), [text[:200] for text in letters]
    stack.advance()  # the genuine job still advances, on its own results only
    assert stack.coordinator.poll() is None, "the coordinator died"
    if case == "replayed registration":  # no second reply: the first one held the token
        request = msgpack.unpackb(stack.first_registration[b"data"])["request_id"]
        assert not conn.exists(keys.reply_key(request))
    for stream, entry_id in added:  # as trimming would: what remains is the dead letter
        conn.xdel(stream, entry_id)
    assert conn.memory_usage(keys.DEADLETTER_STREAM) < 512 * 1024
    used = int(conn.info("memory")["used_memory"]) - stack.redis_base
    grown = rss(stack.coordinator.pid) - stack.rss_base
    print(f"{case}: redis {used / MIB:+.2f} MiB, coordinator RSS {grown / MIB:+.1f} MiB")
    assert used < REDIS_SLACK, (case, used)
    assert grown < RSS_SLACK, (case, grown)
