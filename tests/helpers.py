"""Helpers the test modules share (fixtures: conftest.py; the training side: rank_helpers.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from rq import Queue, SimpleWorker

from coordinator.resilience import ensure_groups
from coordinator.service import Coordinator
from coordinator.settings import PerseusSettings
from protocol import keys
from protocol.models import (
    JobConfig,
    JobInfo,
    ProfilingResult,
    RankInfo,
    RegisterJob,
    RegisterRank,
    Reply,
    encode_message,
    unpack,
)
from protocol.store import JobStore
from protocol.tokens import credentials
from worker_client.hook.session import CoordinatorClient

ROOT = Path(__file__).resolve().parent.parent
FREQS = [1980, 1965, 1950, 1935]
TOY_SCHEDULER = "tests.toy_schedulers:StepDown"
# Jobs built straight in the store (new_job): their ranks, schedulers and clocks.
RANKS = 4
STEPDOWN = "tests.toy_schedulers:StepDown"
SNAPSHOTTING = "tests.toy_schedulers:SnapshotStepDown"
CLOCKS = [1980 - 15 * i for i in range(60)]
# Coordinators that notice unclaimed work and stalled jobs quickly (fault and outage tests).
FAST_RECOVERY = {"PERSEUS_STALL_TIMEOUT": "2", "PERSEUS_RECONCILE_INTERVAL": "0.3"}
# Redis 7 for the tests that must hold on 6.2 and 7 (started privately, on a unix socket).
REDIS7_BINARY = Path("/usr/bin/redis-server")

T = TypeVar("T")


SENT = [0]
"""Round trips (commands or pipelines sent) of this process while a test counts them (the
``count_round_trips`` fixture); module-level so that an rq task run in this process reads it."""


def free_ports(n: int = 1) -> list[int]:
    """``n`` distinct TCP ports of 127.0.0.1 that were free a moment ago."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(
    predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition", poll: float = 0.02
) -> T:
    """Poll ``predicate`` until it returns something true; return that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def subprocess_env(tmp_path: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of a spawned `perseus` or rank process.

    ``PYTHONPATH`` names the repository so that spawned processes can import the test
    schedulers (``tests.toy_schedulers``); ``PERSEUS_SIM_GPU_DIR`` keeps simulated GPUs private
    to the test.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if tmp_path is not None:
        env["PERSEUS_SIM_GPU_DIR"] = str(tmp_path / "simgpu")
    env.update(extra)
    return env


def start_perseus(
    args: Iterable[str],
    tmp_path: Path,
    log: str,
    env: dict[str, str] | None = None,
    python: bool = False,
) -> subprocess.Popen:
    """Start ``perseus ARGS`` (e.g. ``worker --simple``), logging to ``tmp_path/log``.

    The process gets a session of its own, so that killing its group reaches an rq work horse.
    ``python``: ``args`` are the interpreter's own (``-c CODE ...``), not ``perseus``'s.
    """
    out = open(tmp_path / log, "a")
    command = (
        [sys.executable, *args] if python else [sys.executable, "-m", "coordinator.cli", *args]
    )
    return subprocess.Popen(
        command,
        env=subprocess_env(tmp_path, **(env or {})),
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def launch_perseus(
    args: list[str],
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    stderr: int | None = subprocess.PIPE,
    python: bool = False,
    **popen: Any,
) -> subprocess.Popen[str]:
    """Start ``perseus ARGS`` with its output piped, as text, to read in the test.

    ``stderr``: ``subprocess.STDOUT`` merges it into stdout, ``None`` leaves it the test's;
    ``env``: default :func:`subprocess_env`; ``python``: ``args`` are the interpreter's own
    (``-c CODE ...``), not ``perseus``'s.
    """
    command = (
        [sys.executable, *args] if python else [sys.executable, "-m", "coordinator.cli", *args]
    )
    return subprocess.Popen(
        command,
        env=env or subprocess_env(),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        **popen,
    )


def invoke_perseus(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``perseus ARGS`` in this process (click's runner); the exit code and all it printed."""
    from click.testing import CliRunner

    from coordinator.cli import main  # here: not every test module needs the CLI loaded

    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.output


def planner_cli() -> Any:
    """A click group of the planner's two commands, ``optimize`` and ``choose``, to invoke."""
    import click

    from schedulers.planning.cli import choose_command, optimize_command

    @click.group()
    def main() -> None:
        pass

    main.add_command(optimize_command)
    main.add_command(choose_command)
    return main


def run_perseus(
    args: list[str],
    timeout: float | None,
    env: dict[str, str] | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``perseus ARGS`` to its end, its output captured as text.

    Raises:
        subprocess.TimeoutExpired: It ran past ``timeout`` s (None: no limit); it is killed.
        subprocess.CalledProcessError: ``check`` and it failed.
    """
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *args],
        env=env or subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )


# `perseus ARGS` started as a terminal would (SIGINT at its default, not ignored as `&` in a
# script leaves it): start_perseus(["-c", WITH_SIGINT, *ARGS], ..., python=True).
WITH_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, '-m', 'coordinator.cli', *sys.argv[1:]])"
)


def stop(procs: Iterable[subprocess.Popen], timeout: float = 10.0) -> None:
    """Terminate processes and wait for them.

    Raises:
        AssertionError: One did not exit within ``timeout`` after SIGTERM (it is killed, so
            that no process outlives the test).
    """
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    hung = []
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            hung.append(proc.args)
    assert not hung, f"did not stop within {timeout} s of SIGTERM: {hung}"


@contextmanager
def coordinator_thread(
    coord: Coordinator, block_ms: int = 50, join_s: float = 5.0
) -> Iterator[threading.Thread]:
    """``coord`` consuming in a daemon thread inside the block; stopped after it.

    Yields the thread, for a test that checks it runs on or stops. ``join_s``: how long the
    stop may take before the block ends anyway (a test that asserts what a stop leaves needs
    the stop done).
    """
    thread = threading.Thread(target=coord.run, kwargs={"block_ms": block_ms}, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        coord.stop_event.set()
        thread.join(timeout=join_s)


@contextmanager
def running(coord: Coordinator, block_ms: int = 50, join_s: float = 5.0) -> Iterator[Coordinator]:
    """``coord`` consuming in a daemon thread inside the block; stopped after it (see
    :func:`coordinator_thread`)."""
    with coordinator_thread(coord, block_ms, join_s):
        yield coord


def make_settings(redis_url: str, scheduler: str = TOY_SCHEDULER, **kw: Any) -> PerseusSettings:
    """Coordinator settings for tests (the toy StepDown scheduler by default)."""
    return PerseusSettings(redis_url=redis_url, scheduler=scheduler, **kw)


def drain(conn: Any) -> None:
    """Run every queued rq job in this process."""
    SimpleWorker([Queue(keys.RQ_QUEUE, connection=conn)], connection=conn).work(burst=True)


def drain_until(conn: Any, job_id: str, version: int) -> None:
    """Drain until ``job_id`` publishes ``version`` (fails after 10 s).

    The coordinator may enqueue the task after storing what made the job due, in a
    transaction of its own: one drain right after the results are stored could miss it.
    """
    store = JobStore(conn)
    wait_for(lambda: drain(conn) or store.version(job_id) >= version, 10, f"version {version}")


def age_job(conn: Any, job_id: str, seconds: float) -> None:
    """Move every activity stamp of a job ``seconds`` back, as if it had been idle since.

    The jobs index alone is not enough: the sweep checks the stamps no rank can write (the
    job info's, its ranks' proven heartbeats) before deleting a job as idle.
    """
    then = f"{time.time() - seconds:.3f}"
    info = keys.job_info(job_id)
    stamps = {n: then for n in ("created_at", "active_at", "published_at") if conn.hexists(info, n)}
    conn.hset(info, mapping=stamps)
    conn.zadd(keys.JOBS_INDEX, {job_id: float(then)}, xx=True)
    beats = conn.zrange(keys.job_alive(job_id), 0, -1)
    if beats:
        conn.zadd(keys.job_alive(job_id), dict.fromkeys(beats, float(then)))


def register(
    client: CoordinatorClient,
    pp: int = 2,
    scheduler: str | None = None,
    scheduler_args: dict[str, Any] | None = None,
) -> str:
    """Register a ``pp``-stage job (``scheduler``: not the default) and all its ranks.

    Returns:
        The job id, once the coordinator enqueued its first task.
    """
    job = JobInfo(pp_degree=pp, dp_degree=1, tp_degree=1, world_size=pp)
    job_id = client.register_job(job, scheduler, scheduler_args)
    for rank in range(pp):
        client.register_rank(
            job_id,
            RankInfo(rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=FREQS),
        )
    wait_first_task(client.conn, job_id)
    return job_id


def wait_first_task(conn: Any, job_id: str) -> None:
    """Wait until the coordinator enqueued the task of a fully registered job's version 1.

    The last rank's reply comes from the registration's script, before the transaction that
    enqueues the task: a drain() right after the reply could find an empty queue.
    """
    wait_for(lambda: conn.hexists(keys.job_info(job_id), "rq_job"), 10, f"{job_id}'s first task")


def result(rank: int, version: int) -> ProfilingResult:
    """A minimal valid profiling result."""
    return ProfilingResult(rank=rank, schedule_version=version, iter_time=[1.0], iter_energy=[2.0])


def new_job(store: JobStore, job_id: str, scheduler: str) -> None:
    """A job of RANKS ranks registered straight in the store (rank r's token: ``token-r``)."""
    job = JobInfo(job_id=job_id, pp_degree=RANKS, dp_degree=1, tp_degree=1, world_size=RANKS)
    store.create_job(job, JobConfig(scheduler=scheduler), f"1-{len(job_id)}")
    for rank in range(RANKS):
        store.add_rank(
            job,
            RankInfo(rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=CLOCKS),
            token=f"token-{rank}",
        )


def wide_job(store: JobStore, job_id: str, world: int, scheduler: str) -> JobInfo:
    """A ``world``-rank job, every rank registered in one round trip (rank r's token: ``t<r>``)."""
    job = JobInfo(job_id=job_id, pp_degree=world, dp_degree=1, tp_degree=1, world_size=world)
    store.create_job(job, JobConfig(scheduler=scheduler), "1-0")
    batch = store.batch()
    for rank in range(world):
        info = RankInfo(rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=[1980])
        batch.add_rank(
            job, info, now=1.0, credentials=credentials(f"t{rank}"), request_id=str(rank)
        )
    assert batch.execute() == list(range(1, world + 1))
    return job


def report_all(store: JobStore, job_id: str) -> None:
    """Every rank's result for the job's latest version, written straight in the store."""
    info = store.get_job(job_id).info
    version = store.version(job_id)
    for rank in range(RANKS):
        store.add_result(info, result(rank, version))


def job_through(coord: Any, r: Any, world: int) -> str:
    """Register a ``world``-stage job through ``coord`` (one non-blocking step); return its id."""
    ensure_groups(r)
    job = RegisterJob(
        request_id=uuid.uuid4().hex,
        job=JobInfo(pp_degree=world, dp_degree=1, tp_degree=1, world_size=world),
    )
    r.xadd(keys.REGISTRATIONS_STREAM, encode_message(job))
    coord.step(block_ms=None)
    return unpack(Reply, r.lpop(keys.reply_key(job.request_id))).job_id


def rank_request(job_id: str, rank: int, clocks: list[int] | None = None) -> RegisterRank:
    """A registration of stage ``rank`` of ``job_id`` (a fresh request id)."""
    info = RankInfo(
        rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=clocks or [1980, 210]
    )
    return RegisterRank(request_id=uuid.uuid4().hex, job_id=job_id, rank_info=info)
