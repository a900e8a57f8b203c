"""The `perseus` command line as a new user meets it: options, exit codes and messages."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner
from rq import Queue

from coordinator import cli_common
from coordinator.cli import main
from protocol import keys
from protocol.models import JobInfo
from schedulers.planning.plan_file import write_plan_file
from tests.helpers import (
    ROOT,
    free_ports,
    invoke_perseus,
    launch_perseus,
    run_perseus,
    subprocess_env,
    wait_for,
)
from tests.pipes import Output, piped
from worker_client.hook.session import CoordinatorClient


def test_version():
    code, out = invoke_perseus("--version")
    assert code == 0
    assert importlib.metadata.version("perseus-mq") in out


def test_a_misspelt_perseus_variable_is_an_error_with_the_likely_name(redis_url):
    code, out = invoke_perseus(
        "status", env={"PERSEUS_SCHEDULR": "x", "PERSEUS_REDIS_URL": redis_url}
    )
    assert code == 2
    assert "unknown environment variable PERSEUS_SCHEDULR" in out
    assert "did you mean PERSEUS_SCHEDULER?" in out


def test_settings_options_show_their_variable_one_way_with_choices_and_defaults():
    code, out = invoke_perseus("coordinator", "--help")
    assert code == 0
    flat = " ".join(out.split())
    for var in ("REDIS_URL", "SCHEDULER", "SCHEDULER_ARGS", "LOG_LEVEL", "DUMP_DIR"):
        assert f"[env var: PERSEUS_{var}]" in flat
    assert "(env PERSEUS" not in flat
    assert "PointSolution, PointSolution3D" in flat and "Default: none" in flat


def test_every_option_has_help():
    # Walk the whole command tree: an option without help is a rough edge.
    def walk(command, path):
        for param in command.params:
            if param.param_type_name == "option" and param.name != "help":
                assert param.help, f"{path} {param.opts} has no help"
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(main, "perseus")


def test_choose_has_no_short_v_for_value():
    code, out = invoke_perseus("choose", "somewhere", "-v", "1.1")
    assert code == 2 and "No such option '-v'" in out


@pytest.fixture
def job(service, redis_url, tmp_path):
    """A job registered through the streams that runs PointSolution (which takes no target)."""
    plan = tmp_path / "freqs_pipeline_00000.py"
    write_plan_file(plan, [[("forward", 1980), ("backward", 1980)]], {"plan": 0})
    info = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    client = CoordinatorClient(redis_url)
    return client.register_job(info, "PointSolution", {"plan_text": plan.read_text()})


def test_target_refuses_negative_unknown_jobs_and_schedulers_without_targets(redis_url, job):
    code, out = invoke_perseus("target", job, "-1", "--redis-url", redis_url)
    assert (
        code == 2
        and "must be a positive number of seconds from 1e-06 to 86400 (a day), got -1.0" in out
    )
    code, out = invoke_perseus("target", "no-such-job", "0.5", "--redis-url", redis_url)
    assert code == 1 and "no-such-job" in out
    code, out = invoke_perseus("target", job, "0.5", "--redis-url", redis_url)
    assert code == 1
    assert "runs PointSolution, which takes no target" in out and "FrontierScheduler" in out


def test_dump_into_a_file_is_a_clear_error(redis_url, job, tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    code, out = invoke_perseus("dump", job, "--out", str(not_a_folder), "--redis-url", redis_url)
    assert code == 2 and "exists and is not a folder" in out and "Traceback" not in out


def test_acl_that_cannot_write_its_file_prints_no_password(tmp_path):
    # The generated passwords were printed before the write failed: an operator who copied
    # them had passwords that no ACL file held (the next run generates others).
    code, out = invoke_perseus("acl", "--out", str(tmp_path))
    assert code == 1 and f"cannot write {tmp_path}: Is a directory" in out
    assert out.count(str(tmp_path)) == 1, out  # the path once, not again in the OS's words
    assert "password" not in out
    code, out = invoke_perseus("acl", "--out", str(tmp_path / "users.acl"))
    assert code == 0 and out.count("password: ") == 3


@pytest.mark.parametrize("major", ["5", "9", "99"])
def test_acl_refuses_a_redis_major_it_does_not_know(tmp_path, major):
    # 99 was accepted and written with Redis 7's rules, for a server nobody has seen.
    out_file = tmp_path / "users.acl"
    code, out = invoke_perseus("acl", "--out", str(out_file), "--redis-major", major)
    assert code == 2 and "--redis-major" in out and f"{major} is not in the range 6<=x<=8" in out
    assert not out_file.exists() and "password" not in out


def test_acl_for_redis_8_has_redis_7s_rules(tmp_path, monkeypatch):
    for role in ("RANK", "SERVICE", "OPERATOR"):
        monkeypatch.setenv(f"PERSEUS_ACL_{role}_PASSWORD", "same")
    written = {}
    for major in ("7", "8"):
        code, _ = invoke_perseus("acl", "--out", str(tmp_path / major), "--redis-major", major)
        assert code == 0
        written[major] = (tmp_path / major).read_text()
    assert written["8"] == written["7"] and "%R~" in written["8"]


def test_acl_file_is_never_readable_by_others(tmp_path, monkeypatch):
    # The file was written with the umask's mode (0644: world-readable passwords) and only
    # then chmodded: in between, or where the chmod failed, others could read it.
    monkeypatch.setattr(cli_common.os, "chmod", lambda *args, **kw: None)
    old = os.umask(0o022)
    try:
        code, out = invoke_perseus("acl", "--out", str(tmp_path / "users.acl"))
        existing = tmp_path / "existing.acl"
        existing.write_text("old")
        existing.chmod(0o644)
        code2, _ = invoke_perseus("acl", "--out", str(existing))
    finally:
        os.umask(old)
    assert code == 0 and code2 == 0, out
    assert stat.S_IMODE((tmp_path / "users.acl").stat().st_mode) == 0o600
    assert stat.S_IMODE(existing.stat().st_mode) == 0o600


# Run as `perseus ARGV`; at exit, print whether the schedulers' heavy modules were imported.
_HEAVY_AT_EXIT = """
import atexit, sys
heavy = ("scipy", "numpy")
atexit.register(lambda: print("heavy imported:", [m for m in heavy if m in sys.modules]))
from coordinator.cli import main
main(sys.argv[1:])
"""


def test_worker_without_redis_says_so_before_preloading_the_schedulers(tmp_path):
    # Preloading the schedulers (scipy, numpy: about 1.5 s) came first: a worker pointed where
    # no Redis listens said so only after importing them all.
    (port,) = free_ports()
    url = f"redis://127.0.0.1:{port}/0"
    proc = subprocess.run(
        [sys.executable, "-c", _HEAVY_AT_EXIT, "worker", "--redis-url", url],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=subprocess_env(tmp_path),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"cannot reach Redis at {url}" in proc.stderr, proc.stderr
    assert "heavy imported: []" in proc.stdout, proc.stdout


def test_status_watch_refreshes_until_interrupted(redis_url, job, tmp_path):
    proc = launch_perseus(
        ["status", "--watch", "--interval", "0.2"],
        env=subprocess_env(tmp_path, PERSEUS_REDIS_URL=redis_url),
        stderr=subprocess.STDOUT,
    )
    # Interrupted once it refreshed (a slow start must not turn into too few refreshes).
    deadline = time.monotonic() + 30
    seen: list[str] = []
    with piped(proc) as output:
        while sum("perseus status, every 0.2 s" in line for line in seen) < 2:
            line = output.readline(max(0.0, deadline - time.monotonic()))
            assert line, "".join(seen)  # it ended before two refreshes
            seen.append(line)
        proc.send_signal(signal.SIGINT)
        out = "".join(seen) + output.rest(10)
    assert proc.returncode == 0, out
    assert job in out and "jobs: 1" in out


def test_status_json_has_energy_figures(redis_url, job):
    code, out = invoke_perseus("status", "--json", "--redis-url", redis_url)
    assert code == 0
    (listed,) = json.loads(out)["jobs"]
    assert listed["job_id"] == job and listed["first"] is None  # No results yet.


@contextmanager
def perseus_redis(
    tmp_path: Path, preexec_fn: Callable[[], None] | None = None
) -> Iterator[tuple[subprocess.Popen[str], Output, str]]:
    """``perseus redis`` inside the block: the process, its output, the URL it printed."""
    proc = launch_perseus(
        ["redis"], env=subprocess_env(tmp_path), stderr=None, preexec_fn=preexec_fn
    )
    with piped(proc, stop_s=15) as output:
        first = output.readline(60)
        assert "redis url: " in first, first + output.text()
        yield proc, output, first.split("redis url: ", 1)[1].strip()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_perseus_redis_stops_its_server_on_sigterm(tmp_path, sig):
    """SIGHUP too (the terminal closed): it ended the command and left the server running."""
    with perseus_redis(tmp_path) as (proc, output, url):
        conn = redis.Redis.from_url(url)
        server_pid = int(conn.info("server")["process_id"])
        proc.send_signal(sig)
        output.rest(15)

    def gone() -> bool:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, 10, "the redis-server to stop")
    assert not Path(url.removeprefix("unix://")).parent.exists()


def test_perseus_redis_under_nohup_keeps_running_on_sighup(tmp_path):
    def ignore_hangups() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    with perseus_redis(tmp_path, ignore_hangups) as (proc, output, url):
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert proc.poll() is None
        assert redis.Redis.from_url(url).ping()
        proc.terminate()
        output.rest(15)


P2P_ARGS = ("--seconds", "0.5", "--repeats", "1", "--sample-interval", "0.1")


def test_profile_p2p_on_the_simulated_gpu_leaves_no_state_behind(tmp_path):
    shm = Path("/dev/shm")
    before = set(shm.glob("perseus-sim-gpu-*")) if shm.exists() else set()
    env = subprocess_env(tmp_path, TMPDIR=str(tmp_path))
    env.pop("PERSEUS_SIM_GPU_DIR", None)
    out = run_perseus(["profile-p2p", "--gpu", "simulated", *P2P_ARGS], 120, env)
    assert out.returncode == 0, out.stderr
    after = set(shm.glob("perseus-sim-gpu-*")) if shm.exists() else set()
    assert after <= before
    assert not list(tmp_path.glob("perseus-sim-gpu-*"))


def test_profile_fetches_the_sweeps_csv_or_says_why_there_is_none(r, redis_url, job, tmp_path):
    code, out = invoke_perseus(
        "profile", job, "--out", str(tmp_path / "p.csv"), "--redis-url", redis_url
    )
    assert code == 1 and "has no profile yet (PointSolution, at version" in out
    csv_text = "stage,instruction,frequency,time,energy\n0,forward,1980,0.01,3.0\n"
    r.hset(keys.job_artifacts(job), "profile.csv", csv_text)
    code, out = invoke_perseus(
        "profile", job, "--out", str(tmp_path / "p.csv"), "--redis-url", redis_url
    )
    assert code == 0 and "(1 rows)" in out
    assert (tmp_path / "p.csv").read_text() == csv_text
    code, out = invoke_perseus("profile", job, "--out", "-", "--redis-url", redis_url)
    assert code == 0 and out == csv_text


def test_perseus_worker_runs_tasks_with_its_startup_heap_frozen(r, redis_url):
    # gc.freeze() keeps the imported and preloaded heap out of full collections, whose pauses
    # were bench_coordinator's p99 (35-60 ms); a young-generation round every 20,000
    # allocations, not 700, saved about 1 ms of a 64-rank version. The tasks report both.
    queue = Queue(keys.RQ_QUEUE, connection=r)
    job = queue.enqueue("gc.get_freeze_count")
    threshold = queue.enqueue("gc.get_threshold")
    proc = run_perseus(["worker", "--burst", "--redis-url", redis_url], 120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert job.return_value(refresh=True) > 10_000  # the imports and preloaded schedulers
    assert threshold.return_value(refresh=True)[0] == 20_000


def test_status_shows_rq_suspended_until_resumed(r, redis_url):
    from rq.suspension import resume, suspend

    suspend(r)
    try:
        code, out = invoke_perseus("status", "--redis-url", redis_url)
        assert code == 0 and "SUSPENDED (`rq suspend`)" in out
    finally:
        resume(r)
    code, out = invoke_perseus("status", "--redis-url", redis_url)
    assert code == 0 and "SUSPENDED" not in out


def test_perseus_redis_appendonly_says_its_file_goes_at_stop_too():
    # "Turn on append-only persistence", then "the data is deleted": a Redis user read that the
    # data would outlive the command; the append-only file lives in the folder deleted at stop.
    result = CliRunner().invoke(main, ["redis", "--help"])
    assert result.exit_code == 0
    said = " ".join(result.output.split())
    assert "deleted with it when the command stops" in said, said


class _SignalledOnCollection:
    """Sends this process SIGTERM when collected: where Python drops what a handler raises."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGTERM)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the drop itself
def test_a_stop_signal_whose_interrupt_python_dropped_still_interrupts():
    """A SIGTERM that landed in a weakref callback during the example's clean-up raised its
    KeyboardInterrupt there, where Python ignores it: the process ended with status 0."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with cli_common.stop_signals_interrupt():
            _SignalledOnCollection()  # collected at once; its __del__ drops the interrupt
    assert signal.getsignal(signal.SIGTERM) is before
