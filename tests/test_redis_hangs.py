"""Redis that hangs (a server stopped with SIGSTOP, a network that drops packets) or goes away.

What an operator meets: a stop is honoured within seconds, an inspection command gives up
within its command timeout and says so in one line, and no entry is lost.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from coordinator.embedded import EmbeddedRedis
from protocol import keys
from protocol.cli_options import COMMAND_TIMEOUT_S, connect_or_fail
from protocol.connection import SOCKET_TIMEOUT_S
from protocol.models import ReportResult, encode_message
from protocol.store import JobStore
from tests.helpers import (
    ROOT,
    WITH_SIGINT,
    free_ports,
    launch_perseus,
    new_job,
    result,
    run_perseus,
    start_perseus,
    stop,
    subprocess_env,
    wait_for,
)
from tests.pipes import piped
from tests.sentinel_server import SENTINEL_SERVICE, start_sentinel
from tests.silent_proxy import SilentProxy

PASSWORD = "hang-test-secret"
# Well under the 30 s that a stopped Redis held each of these before, with room for a busy CI.
BOUND_S = 20
# How long a command may run, counted from the end of its imports (see TIMED): one wait of
# its command timeout, not two (a retry), nor the services' 30 s socket timeout.
RAN_BOUND_S = 2 * COMMAND_TIMEOUT_S
# Only a guard against a command that never ends: a loaded machine (load 8-10 on 2 cores)
# took over 20 s to start a dozen commands at once, which a bound counted from their launch
# failed. A command that waited the old 30 s still ends within it, and fails on RAN_BOUND_S.
HANG_S = 2 * SOCKET_TIMEOUT_S
RAN_VARIABLE = "HANG_TEST_RAN_S"  # not PERSEUS_*: perseus refuses variables it does not know
IMPORTS_VARIABLE = "HANG_TEST_IMPORTS"
# `perseus ARGS` as `python -c TIMED ARGS`: as it exits, it writes to the file that
# $HANG_TEST_RAN_S names the seconds it ran once its modules were imported: the CLI's, and
# those a command imports as it runs, named in $HANG_TEST_IMPORTS (the demo's took 12 s).
TIMED = (
    "import atexit, importlib, os, time\n"
    "import coordinator.cli\n"
    f"for name in filter(None, os.environ.get({IMPORTS_VARIABLE!r}, '').split(',')):\n"
    "    importlib.import_module(name)\n"
    "start = time.monotonic()\n"
    f"path = os.environ[{RAN_VARIABLE!r}]\n"
    "atexit.register(lambda: open(path, 'w').write(repr(time.monotonic() - start)))\n"
    "coordinator.cli.main()\n"
)


@pytest.fixture
def private_redis() -> Iterator[EmbeddedRedis]:
    """A redis-server of this test's own, on a free TCP port, with a password."""
    (port,) = free_ports()
    with EmbeddedRedis(port=port, password=PASSWORD) as server:
        yield server


@contextmanager
def stopped(server: EmbeddedRedis) -> Iterator[None]:
    """``server`` stopped with SIGSTOP (it accepts connections and answers nothing) inside."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def members(conn: redis.Redis) -> set[str]:
    """Consumers in the coordinators' group on the results stream."""
    try:
        rows = conn.xinfo_consumers(keys.RESULTS_STREAM, keys.COORDINATOR_GROUP)
    except redis.ResponseError:
        return set()
    return {row["name"].decode() for row in rows}


def coordinator_args(url: str) -> list[str]:
    return ["coordinator", "--redis-url", url, "--scheduler", ""]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_coordinator_stops_within_seconds_while_redis_hangs(private_redis, tmp_path, signum):
    # Its blocking read in flight waited the whole socket timeout (30 s) before the loop saw
    # the stop, past `docker stop`'s 10 s: the stop now cuts it after the read's block time.
    conn = redis.Redis.from_url(private_redis.url)
    args = coordinator_args(private_redis.url)
    proc = start_perseus(["-c", WITH_SIGINT, *args], tmp_path, "coordinator.log", python=True)
    try:
        wait_for(lambda: members(conn), 30, "the coordinator to join the group")
        with stopped(private_redis):
            # Longer than its read's block (1 s): the command it sends next, or the read in
            # flight, waits on the stopped server.
            time.sleep(1.5)
            proc.send_signal(signum)
            assert proc.wait(timeout=BOUND_S) == 0
    finally:
        stop([proc])
    log = (tmp_path / "coordinator.log").read_text()
    assert "cutting its connections" in log, log
    assert "Traceback" not in log and "retrying" not in log, log  # a stop, not an outage


def test_entries_a_hanging_redis_held_stay_pending_and_are_processed_after_a_restart(
    private_redis, tmp_path
):
    # A network that swallows the coordinator's acknowledgements: it had read an entry and
    # sent its outcome (a dead letter, here) with the XACK, and no reply came.
    conn = redis.Redis.from_url(private_redis.url)
    with SilentProxy(private_redis.url) as proxy:
        hidden = proxy.url.replace("redis://", f"redis://:{PASSWORD}@")
        first = start_perseus(coordinator_args(hidden), tmp_path, "first.log")
        try:
            (name,) = wait_for(lambda: members(conn), 30, "the coordinator to join the group")
            proxy.silence_from(b"XACK")
            entry = encode_message(ReportResult(job_id="no-such-job", result=result(0, 1)))
            entry_id = conn.xadd(keys.RESULTS_STREAM, entry).decode()
            wait_for(proxy.silent.is_set, 30, "the coordinator to send the acknowledgement")
            first.terminate()
            assert first.wait(timeout=BOUND_S) == 0
        finally:
            stop([first])
    pending = conn.xpending_range(keys.RESULTS_STREAM, keys.COORDINATOR_GROUP, "-", "+", 10)
    assert [(p["message_id"].decode(), p["consumer"].decode()) for p in pending] == [
        (entry_id, name)
    ]
    assert conn.xlen(keys.DEADLETTER_STREAM) == 0  # the transaction never reached Redis
    second = start_perseus(coordinator_args(private_redis.url), tmp_path, "second.log")
    try:
        wait_for(lambda: conn.xlen(keys.DEADLETTER_STREAM) == 1, 60, "the claimed entry")
        wait_for(
            lambda: conn.xpending(keys.RESULTS_STREAM, keys.COORDINATOR_GROUP)["pending"] == 0,
            10,
            "its acknowledgement",
        )
    finally:
        stop([second])
    (letter,) = conn.xrange(keys.DEADLETTER_STREAM)
    assert entry_id.encode() in letter[1].values(), letter


def launch_timed(
    args: list[str], ran: Path, cwd: Path = ROOT, env: dict[str, str] | None = None, **launch: Any
) -> subprocess.Popen[str]:
    """``perseus ARGS`` (see :func:`launch_perseus`) that writes to ``ran`` as it exits how
    long it ran once its modules were imported (read it with :func:`ran_s`)."""
    env = {**(env or subprocess_env()), RAN_VARIABLE: str(ran)}
    return launch_perseus(["-c", TIMED, *args], cwd, env, python=True, **launch)


def ran_s(ran: Path) -> float:
    """The seconds a :func:`launch_timed` command ran once imported (it must have exited)."""
    assert ran.exists(), f"{ran} was not written: the command did not exit by itself"
    return float(ran.read_text())


def killed(procs: list[subprocess.Popen[str]]) -> None:
    """Kill and reap each of ``procs`` (those that ended already are only reaped)."""
    for proc in procs:
        proc.kill()
        proc.wait()


@contextmanager
def reaped() -> Iterator[list[subprocess.Popen[str]]]:
    """A list to put each process started in; every one is killed and reaped after the block
    (one that timed out or failed an assertion outlived the test before)."""
    procs: list[subprocess.Popen[str]] = []
    try:
        yield procs
    finally:
        killed(procs)


def launch_each(
    commands: list[list[str]], server: EmbeddedRedis, cwd: Path, ran: Path, **launch: Any
) -> list[subprocess.Popen[str]]:
    """``perseus COMMAND --redis-url URL`` of ``server`` for each command, all at once.

    Each is timed (:func:`launch_timed`) into ``ran/<its index>``; if one fails to start, those
    started are killed.
    """
    ran.mkdir(exist_ok=True)
    procs: list[subprocess.Popen[str]] = []
    try:
        for i, args in enumerate(commands):
            args = [*args, "--redis-url", server.url]
            procs.append(launch_timed(args, ran / str(i), cwd, **launch))
    except BaseException:
        killed(procs)
        raise
    return procs


def outputs_of(
    procs: list[subprocess.Popen[str]], meanwhile: Callable[[], None] | None = None
) -> list[tuple[str, str]]:
    """Each process's ``(stdout, stderr)`` within ``HANG_S`` in all; all are killed whatever
    happens (a timeout, a failure of ``meanwhile``).

    ``meanwhile`` runs first, while they run (a fault to inject, say).
    """
    try:
        if meanwhile is not None:
            meanwhile()
        deadline = time.monotonic() + HANG_S
        return [proc.communicate(timeout=max(0.0, deadline - time.monotonic())) for proc in procs]
    finally:
        killed(procs)


def fault(proxy: SilentProxy, kind: str, what: str) -> Callable[[], None]:
    """For :func:`outputs_of`: ``"hangs"``, nothing (the proxy is silent already); ``"goes
    away"``, once the proxy swallowed ``what``, every connection closed as by a Redis that exits.
    """

    def inject() -> None:
        if kind == "goes away":
            wait_for(proxy.silent.is_set, HANG_S, what)  # the command's start is in it
            proxy.close()

    return inject


def perseus(args: list[str], timeout: float = BOUND_S) -> subprocess.CompletedProcess[str]:
    """Run ``perseus ARGS`` to its end; ``subprocess.TimeoutExpired`` after ``timeout`` s."""
    return run_perseus(args, timeout)


OPERATOR_COMMANDS = [
    ["status"],
    ["status", "--json"],
    ["jobs", "list"],
    ["jobs", "delete", "some-job"],
    ["jobs", "finish", "some-job"],
    ["dump", "some-job"],
    ["profile", "some-job"],
    ["target", "some-job", "1.5"],
    ["deadletter", "list"],
    ["deadletter", "show", "1-1"],
    ["deadletter", "replay", "--all"],
    ["deadletter", "purge", "--all"],
]


def test_operator_commands_give_up_on_a_hanging_redis_with_one_line(private_redis, tmp_path):
    # Each waited its PING's 30 s socket timeout, then said "Timeout reading from socket".
    shown = f"redis://:***@127.0.0.1:{private_redis.port}/0"
    ran = tmp_path / "ran"
    with stopped(private_redis), reaped() as procs:
        # In tmp_path: dump's ./dump folder.
        procs += launch_each(
            OPERATOR_COMMANDS, private_redis, tmp_path, ran, stderr=subprocess.STDOUT
        )
        # A longer wait is asked for in the URL, as the message says.
        url = f"{private_redis.url}?socket_timeout=1"
        procs.append(launch_timed(["status", "--redis-url", url], ran / "longer", tmp_path))
        outputs = outputs_of(procs)
    *each, (_, longer_err) = outputs
    for i, (args, proc, (output, _)) in enumerate(
        zip(OPERATOR_COMMANDS, procs[:-1], each, strict=True)
    ):
        assert proc.returncode == 1, (args, output)
        assert output == (
            f"Error: Redis at {shown} did not answer within {COMMAND_TIMEOUT_S:g} s (Timeout "
            "reading from socket); to wait longer, add ?socket_timeout=SECONDS to the URL\n"
        ), args
        assert ran_s(ran / str(i)) < RAN_BOUND_S, args
    assert ran_s(ran / "longer") < RAN_BOUND_S
    assert procs[-1].returncode == 1
    assert longer_err == (
        f"Error: Redis at {shown}?socket_timeout=1 did not answer within 1 s (Timeout reading "
        "from socket); to wait longer, raise the URL's ?socket_timeout=\n"
    ), longer_err
    assert PASSWORD not in longer_err
    assert not (tmp_path / "dump").exists()


SERVICES = [
    ["coordinator", "--scheduler", ""],
    ["worker", "--no-preload"],
    ["demo", "--out", "demo-out"],
]
SERVICE_IMPORTS = "coordinator.demo"  # imported as `perseus demo` runs (torch, matplotlib...)


def test_a_service_started_against_a_hanging_redis_says_so_within_seconds(private_redis, tmp_path):
    # Their first PING waited the services' 30 s socket timeout (measured 30.5-31.2 s).
    shown = f"redis://:***@127.0.0.1:{private_redis.port}/0"
    ran = tmp_path / "ran"
    with stopped(private_redis):
        env = subprocess_env(tmp_path, **{IMPORTS_VARIABLE: SERVICE_IMPORTS})
        procs = launch_each(SERVICES, private_redis, tmp_path, ran, env=env)
        outputs = outputs_of(procs)
    for i, (args, proc, (_out, err)) in enumerate(zip(SERVICES, procs, outputs, strict=True)):
        assert proc.returncode == 1, (args, err)
        assert ran_s(ran / str(i)) < RAN_BOUND_S, args
        assert err.endswith(
            f"Error: Redis at {shown} did not answer within {COMMAND_TIMEOUT_S:g} s (Timeout "
            "reading from socket)\n"
        ), (args, err)
    # Only the check is that short: a service's commands still wait its longer timeout.
    conn = connect_or_fail(private_redis.url, SOCKET_TIMEOUT_S, dedicated=True)
    try:
        assert conn.connection is not None
        assert conn.connection.socket_timeout == SOCKET_TIMEOUT_S
    finally:
        conn.close()


def test_a_demo_stopped_while_redis_hangs_says_once_that_it_did_not_leave_the_group(
    private_redis, tmp_path
):
    # The demo closed its Redis client while its coordinator's tidy-up still waited: after
    # "stopping without leaving the consumer group" came "could not leave the group: Bad
    # file descriptor" (or "Connection closed by server.").
    args = ["demo", "--stages", "2", "--microbatches", "2", "--redis-url", private_redis.url]
    proc = launch_perseus(
        args,
        tmp_path,
        subprocess_env(tmp_path, PYTHONUNBUFFERED="1"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, like a job in a terminal
    )
    try:
        with piped(proc) as out:
            lines = [out.readline(300)]
            while lines[-1] and not lines[-1].startswith("[1/4]"):
                lines.append(out.readline(300))
            time.sleep(2)  # ranks, coordinator and worker are busy profiling
            with stopped(private_redis):
                time.sleep(1.5)  # the coordinator's next read waits on the stopped server
                os.killpg(proc.pid, signal.SIGINT)
                output = "".join(lines) + out.rest(60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 1 and output.endswith("Aborted!\n"), output
    assert "Traceback" not in output, output
    assert output.count("stopping without leaving the consumer group") == 1, output
    assert "could not leave" not in output, output


def test_a_sentinel_urls_command_timeout_is_set_as_the_hint_says(private_redis, tmp_path):
    # A sentinel URL refused ?socket_timeout=, so its 5 s could not be changed; its error
    # gave no hint (a redis:// URL's says to add it).
    (port,) = free_ports()
    # A master that hangs while its sentinel still names it: with the sentinel's usual 1 s,
    # a loaded machine's slow start found the master flagged down (no master named at all).
    sentinel = start_sentinel(tmp_path, port, private_redis.port, 1, PASSWORD, 120_000)
    try:
        wait_for(
            lambda: redis.Redis(port=port).sentinel_get_master_addr_by_name(SENTINEL_SERVICE),
            BOUND_S,
            "the sentinel to know the master",
        )
        url = f"redis+sentinel://:{PASSWORD}@127.0.0.1:{port}/{SENTINEL_SERVICE}"
        ran = tmp_path / "ran"
        ran.mkdir()
        with stopped(private_redis), reaped() as procs:
            procs.append(launch_timed(["status", "--redis-url", url], ran / "default"))
            args = ["status", "--redis-url", f"{url}?socket_timeout=1"]
            procs.append(launch_timed(args, ran / "shorter"))
            (_, err), (_, shorter_err) = outputs_of(procs)
    finally:
        sentinel.terminate()
        sentinel.wait(timeout=10)
    shown = url.replace(PASSWORD, "***")
    hint = "; to wait longer, add ?socket_timeout=SECONDS to the URL\n"
    default, shorter = procs
    assert default.returncode == 1 and err == (
        f"Error: Redis at {shown} did not answer within {COMMAND_TIMEOUT_S:g} s (Timeout "
        f"reading from socket){hint}"
    ), err
    assert shorter.returncode == 1 and shorter_err == (
        f"Error: Redis at {shown}?socket_timeout=1 did not answer within 1 s (Timeout "
        "reading from socket); to wait longer, raise the URL's ?socket_timeout=\n"
    ), shorter_err
    assert ran_s(ran / "default") < RAN_BOUND_S and ran_s(ran / "shorter") < RAN_BOUND_S


@pytest.mark.parametrize("kind", ["hangs", "goes away"])
def test_redis_that_hangs_or_goes_away_mid_command_is_one_line_not_a_traceback(
    private_redis, tmp_path, kind
):
    # After the command's PING succeeded: a traceback, after 30 s for a hang.
    with SilentProxy(private_redis.url) as proxy:
        url = proxy.url.replace("redis://", f"redis://:{PASSWORD}@")
        proxy.silence_from(b"XLEN")  # `perseus status` reads the streams' lengths
        proc = launch_timed(["status", "--redis-url", url], tmp_path / "ran")
        what = "status to ask for a stream's length"
        ((out, err),) = outputs_of([proc], fault(proxy, kind, what))
    shown = proxy.url.replace("redis://", "redis://:***@")
    assert proc.returncode == 1, err
    assert out == ""
    assert ran_s(tmp_path / "ran") < RAN_BOUND_S
    if kind == "hangs":
        said = f"Error: Redis at {shown} did not answer within {COMMAND_TIMEOUT_S:g} s ("
    else:
        said = f"Error: lost the connection to Redis at {shown}: "
    assert err.startswith(said) and err.count("\n") == 1, err


@pytest.mark.parametrize("kind", ["hangs", "goes away"])
def test_a_dump_that_fails_part_way_says_its_folder_is_incomplete(private_redis, tmp_path, kind):
    # It left the files written so far, which looked like a whole dump, and its one line
    # did not say so; a dump run again into a folder kept the earlier dump's files as well.
    job_id = "2026-11-28-00-00-00.000+dp1+pp4+tp1+StepDown+dump"
    new_job(JobStore(redis.Redis.from_url(private_redis.url)), job_id, "StepDown")
    folder = tmp_path / "dump" / job_id
    whole = perseus(["dump", job_id, "--redis-url", private_redis.url, "--out", str(folder.parent)])
    assert whole.returncode == 0 and (folder / "complete").exists(), whole.stderr
    with SilentProxy(private_redis.url) as proxy:
        url = proxy.url.replace("redis://", f"redis://:{PASSWORD}@")
        proxy.silence_from(b"LRANGE")  # the journal, read after job.json and ranks.json
        args = ["dump", job_id, "--redis-url", url]
        proc = launch_timed(args, tmp_path / "ran", tmp_path)  # into ./dump
        what = "the dump to read the journal"
        ((out, err),) = outputs_of([proc], fault(proxy, kind, what))
    shown = proxy.url.replace("redis://", "redis://:***@")
    assert proc.returncode == 1 and out == "", err
    assert ran_s(tmp_path / "ran") < RAN_BOUND_S
    said = f"Error: the dump in dump/{job_id} is incomplete (it has no 'complete' file; run "
    said += "it again): "
    if kind == "hangs":
        said += f"Redis at {shown} did not answer within {COMMAND_TIMEOUT_S:g} s ("
    else:
        said += f"lost the connection to Redis at {shown}: "
    assert err.startswith(said) and err.count("\n") == 1, err
    assert (folder / "ranks.json").exists()  # what it had written
    assert not (folder / "complete").exists()  # the earlier dump's went first
