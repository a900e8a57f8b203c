"""The `perseus` command line as a new user meets it: options, exit codes and messages."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import pytest
import redis
from click.testing import CliRunner
from rq import Queue

from coordinator.cli import main
from coordinator.service import Coordinator
from protocol import keys
from protocol.connection import connect
from protocol.exceptions import ConfigError
from protocol.models import JobInfo
from schedulers.planning.plan_file import write_plan_file
from tests.helpers import (
    ROOT,
    free_ports,
    launch_perseus,
    make_settings,
    run_perseus,
    subprocess_env,
    wait_for,
)
from worker_client.hook.session import CoordinatorClient


def perseus(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``perseus ARGS`` in this process; return the exit code and everything printed."""
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.output


def first_line(args: list[str], tmp_path: Path, variables: dict[str, str]) -> tuple[str, bool, str]:
    """Start ``perseus ARGS`` (``variables`` set), read its first line, then stop it.

    Returns:
        That line, whether it still ran after printing it, and what it printed afterwards.
    """
    env = subprocess_env(tmp_path, **variables)
    proc = launch_perseus(args, env=env, stderr=subprocess.STDOUT)
    timer = threading.Timer(60, proc.kill)  # one that ignores SIGTERM: the read ends anyway
    timer.start()
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        ran_on = proc.poll() is None
        proc.terminate()
        # All output through the one reader: communicate() reads the pipe itself and missed
        # what readline() had buffered past the first line (a refusal's message, say).
        rest = proc.stdout.read()
        proc.wait(timeout=10)
    finally:
        timer.cancel()
        proc.kill()  # no-op once it exited
    return first, ran_on, rest


def test_version():
    code, out = perseus("--version")
    assert code == 0
    assert importlib.metadata.version("perseus-mq") in out


def test_a_misspelt_perseus_variable_is_an_error_with_the_likely_name(redis_url):
    code, out = perseus("status", env={"PERSEUS_SCHEDULR": "x", "PERSEUS_REDIS_URL": redis_url})
    assert code == 2
    assert "unknown environment variable PERSEUS_SCHEDULR" in out
    assert "did you mean PERSEUS_SCHEDULER?" in out


def test_settings_options_show_their_variable_one_way_with_choices_and_defaults():
    code, out = perseus("coordinator", "--help")
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
    code, out = perseus("choose", "somewhere", "-v", "1.1")
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
    code, out = perseus("target", job, "-1", "--redis-url", redis_url)
    assert (
        code == 2
        and "must be a positive number of seconds from 1e-06 to 86400 (a day), got -1.0" in out
    )
    code, out = perseus("target", "no-such-job", "0.5", "--redis-url", redis_url)
    assert code == 1 and "no-such-job" in out
    code, out = perseus("target", job, "0.5", "--redis-url", redis_url)
    assert code == 1
    assert "runs PointSolution, which takes no target" in out and "FrontierScheduler" in out


def test_dump_into_a_file_is_a_clear_error(redis_url, job, tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    code, out = perseus("dump", job, "--out", str(not_a_folder), "--redis-url", redis_url)
    assert code == 2 and "exists and is not a folder" in out and "Traceback" not in out


def test_acl_that_cannot_write_its_file_prints_no_password(tmp_path):
    # The generated passwords were printed before the write failed: an operator who copied
    # them had passwords that no ACL file held (the next run generates others).
    code, out = perseus("acl", "--out", str(tmp_path))
    assert code == 1 and f"cannot write {tmp_path}" in out
    assert "password" not in out
    code, out = perseus("acl", "--out", str(tmp_path / "users.acl"))
    assert code == 0 and out.count("password: ") == 3


def test_a_redis_url_with_a_bad_database_or_query_parameter_is_one_line(redis_url):
    # redis-py took /abc as database 0 (a shared server's data, silently), and passed a
    # misspelt query parameter to the connection: a TypeError traceback at the first command.
    code, out = perseus("status", "--redis-url", "redis://127.0.0.1:1/abc")
    assert code == 1 and "the database 'abc' in the URL's path is not a number" in out
    sep = "&" if "?" in redis_url else "?"
    for command in (("status",), ("deadletter", "list"), ("jobs", "list")):
        code, out = perseus(*command, "--redis-url", f"{redis_url}{sep}ssl_ca_cert=/ca.pem")
        assert code == 1, out
        assert "unknown query parameter(s) ssl_ca_cert" in out and "Traceback" not in out
    code, out = perseus("status", "--redis-url", f"{redis_url}{sep}db=0&socket_timeout=5")
    assert code == 0, out


@pytest.mark.parametrize("password", ["se/cret", "se?cret", "se#cret", "se@cr/et"])
def test_a_password_a_url_cannot_hold_is_named_as_the_problem_and_never_printed(password):
    # docker-compose.yml puts PERSEUS_REDIS_PASSWORD into the services' URLs: one made with
    # `openssl rand -base64` holds "/", and every restart of the coordinator and the workers
    # printed the URL with the password in clear (or redis-py's "Port could not be cast to
    # integer value as 'se'") into `docker compose logs` and the healthcheck's log.
    from coordinator.health import check

    url = f"redis://:{password}@redis:6379/0"
    for command in (("status",), ("jobs", "list"), ("coordinator",), ("worker",)):
        code, out = perseus(*command, env={"PERSEUS_REDIS_URL": url})
        assert code != 0, out
        assert "cret" not in out and "'se'" not in out and "Traceback" not in out, out
        assert "redis://:***@" in out, out
        if "/" in password:
            assert "its password holds '/'" in out and "%2F" in out, out
    ok, message = check(url, "host", 30)
    assert not ok and "cret" not in message and "'se'" not in message, message


def test_a_query_parameter_redis_py_parses_but_the_connection_does_not_take_is_refused(redis_url):
    # redis-py parses ?timeout= (its BlockingConnectionPool's) and ?ssl_check_hostname= (a TLS
    # connection's) in any URL and hands them to the connection: on a plain one, the TypeError
    # traceback at the first command that the check of query parameters is there to prevent.
    sep = "&" if "?" in redis_url else "?"
    for name, value in (("timeout", "5"), ("ssl_check_hostname", "false")):
        with pytest.raises(ConfigError, match=rf"unknown query parameter\(s\) {name} "):
            connect(f"{redis_url}{sep}{name}={value}", ping=True)
    code, out = perseus("status", "--redis-url", f"{redis_url}{sep}ssl_ca_certs=/ca.pem")
    assert code == 1 and "TLS settings need a rediss:// URL" in out, out
    # Database digits are ASCII ones (redis-py read an Arabic-Indic one as database 1).
    with pytest.raises(ConfigError, match="in the URL's path is not a number"):
        connect("redis://127.0.0.1:1/\u0661")
    # What redis-py's connection takes still passes, TLS settings with rediss:// too.
    taken = "db=0&socket_timeout=5&health_check_interval=10&protocol=3&max_connections=8"
    connect(f"{redis_url}{sep}{taken}&client_name=t", ping=True).close()
    connect("rediss://127.0.0.1:1/0?ssl_cert_reqs=none&ssl_check_hostname=false").close()


def test_a_query_parameter_without_a_value_is_refused_by_name() -> None:
    # redis-py's parse_qs drops ?name and ?name= unsaid: a misspelt ?ssl_ca_cert passed.
    for query in ("?foo", "?foo=", "?socket_timeout=5&foo"):
        with pytest.raises(ConfigError, match=r"unknown query parameter\(s\) foo for a redis://"):
            connect(f"redis://127.0.0.1:1/0{query}")
    # A setting the connection takes, but with no value, would do nothing as well.
    with pytest.raises(ConfigError, match=r"query parameter\(s\) socket_timeout without a value"):
        connect("redis://127.0.0.1:1/0?socket_timeout=")
    connect("redis://127.0.0.1:1/0?socket_timeout=5").close()


def test_a_database_path_takes_one_trailing_slash_and_nothing_else() -> None:
    # redis-py reads /0/ as database 0 (it drops every slash): accepted as it is.
    for path, db in (("/0/", 0), ("/3/", 3), ("/3", 3), ("/", 0), ("", 0)):
        client = connect(f"redis://127.0.0.1:1{path}")
        assert client.connection_pool.connection_kwargs.get("db", 0) == db, path
        client.close()
    # redis-py reads /1/2 as database 12: refused, naming the path, the password hidden.
    for path in ("/1/2", "/1/2/", "/0//", "//"):
        with pytest.raises(ConfigError, match=f"the URL's path '{path}' is not /DB") as caught:
            connect(f"redis://user:s3cret@127.0.0.1:1{path}")
        assert "s3cret" not in str(caught.value) and "user:***@" in str(caught.value)
    with pytest.raises(ConfigError, match="the database 'abc' in the URL's path is not a number"):
        connect("redis://127.0.0.1:1/abc/")


def test_coordinator_without_scheduler_settings_starts(redis_url, tmp_path):
    first, ran_on, rest = first_line(["coordinator", "--redis-url", redis_url], tmp_path, {})
    assert first.startswith("perseus coordinator: scheduler=none (each job names its own")
    assert ran_on, first + rest


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--scheduler", "PointSolution"], """--scheduler-args '{"solution_path": "plan.py"}'"""),
        (
            [
                "--scheduler",
                "PointSolution",
                "--scheduler-args",
                '{"solution_path": "/no/plan"}',
            ],
            "/no/plan: plan file not found",
        ),
        (
            [
                "--scheduler",
                "FrontierScheduler",
                "--scheduler-args",
                '{"frontier_dir": "/no/d"}',
            ],
            "/no/d: no such folder",
        ),
        (["--scheduler", "NoSuchScheduler"], "unknown scheduler 'NoSuchScheduler'"),
        # Zeus's server took a solution_path alone (PointSolution was its default).
        (
            ["--scheduler-args", '{"solution_path": "plan.py"}'],
            "scheduler_args ['solution_path'] are set but no scheduler",
        ),
    ],
)
def test_coordinator_refuses_bad_scheduler_settings_with_the_option_to_add(
    redis_url, args, expected
):
    code, out = perseus("coordinator", "--redis-url", redis_url, *args)
    assert code == 2, out
    assert expected in out
    assert "perseus coordinator --scheduler ''" in out


@pytest.mark.parametrize(
    "variables",
    [
        {"PERSEUS_SCHEDULER_ARGS": '{"frontier_dir": "plans"}'},
        {
            "PERSEUS_SCHEDULER": "PointSolution3D",
            "PERSEUS_SCHEDULER_ARGS": '{"solution_path": "DIR/freqs_pipeline_00042.py"}',
        },
    ],
)
def test_the_no_default_start_a_refusal_offers_starts_with_the_same_variables(
    redis_url, tmp_path, variables
):
    # Settings exported for the services (README): the offered command must start as it is
    # written; `--scheduler ''` alone left PERSEUS_SCHEDULER_ARGS set and was refused again.
    code, out = perseus("coordinator", "--redis-url", redis_url, env=variables)
    assert code == 2, out
    offered = next(line for line in out.splitlines() if "(no default" in line)
    argv = shlex.split(offered.split("(no default")[0])
    assert argv[:2] == ["perseus", "coordinator"], offered
    # The start line, or a refusal's "Usage:".
    first, _, rest = first_line([*argv[1:], "--redis-url", redis_url], tmp_path, variables)
    assert first.startswith("perseus coordinator: scheduler=none (each job"), first + rest


def test_no_redis_at_the_url_says_what_to_start(tmp_path):
    # A first `perseus status` where no Redis runs: what is wrong, and what to do about it.
    (port,) = free_ports()
    for url in (f"redis://127.0.0.1:{port}/0", f"unix://{tmp_path}/redis.sock"):
        code, out = perseus("status", "--redis-url", url)
        assert code == 1, out
        assert f"cannot reach Redis at {url}" in out
        assert "no Redis listens there" in out and "`perseus redis`" in out, out
        assert "--redis-url or PERSEUS_REDIS_URL" in out


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
    timer = threading.Timer(30, proc.kill)
    timer.start()
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        while sum("perseus status, every 0.2 s" in line for line in seen) < 2:
            line = proc.stdout.readline()
            assert line, "".join(seen)  # ended (or killed after 30 s) before two refreshes
            seen.append(line)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=10)
    finally:
        timer.cancel()
        proc.kill()  # no-op once it exited
    out = "".join(seen) + rest
    assert proc.returncode == 0, out
    assert job in out and "jobs: 1" in out


def test_status_json_has_energy_figures(redis_url, job):
    code, out = perseus("status", "--json", "--redis-url", redis_url)
    assert code == 0
    (listed,) = json.loads(out)["jobs"]
    assert listed["job_id"] == job and listed["first"] is None  # No results yet.


def _start_perseus_redis(
    tmp_path: Path, preexec_fn: Callable[[], None] | None = None
) -> tuple[subprocess.Popen, str]:
    """Start ``perseus redis``; the process and the URL it printed."""
    proc = launch_perseus(
        ["redis"], env=subprocess_env(tmp_path), stderr=None, preexec_fn=preexec_fn
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split("redis url: ", 1)[1].strip()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_perseus_redis_stops_its_server_on_sigterm(tmp_path, sig):
    """SIGHUP too (the terminal closed): it ended the command and left the server running."""
    proc, url = _start_perseus_redis(tmp_path)
    conn = redis.Redis.from_url(url)
    server_pid = int(conn.info("server")["process_id"])
    proc.send_signal(sig)
    proc.wait(timeout=15)

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

    proc, url = _start_perseus_redis(tmp_path, ignore_hangups)
    try:
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert proc.poll() is None
        assert redis.Redis.from_url(url).ping()
    finally:
        proc.terminate()
        proc.wait(timeout=15)


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
    code, out = perseus("profile", job, "--out", str(tmp_path / "p.csv"), "--redis-url", redis_url)
    assert code == 1 and "has no profile yet (PointSolution, at version" in out
    csv_text = "stage,instruction,frequency,time,energy\n0,forward,1980,0.01,3.0\n"
    r.hset(keys.job_artifacts(job), "profile.csv", csv_text)
    code, out = perseus("profile", job, "--out", str(tmp_path / "p.csv"), "--redis-url", redis_url)
    assert code == 0 and "(1 rows)" in out
    assert (tmp_path / "p.csv").read_text() == csv_text
    code, out = perseus("profile", job, "--out", "-", "--redis-url", redis_url)
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


class _Seen:
    """Stands in for the coordinator's loop: records the settings a start built, runs nothing."""

    settings: ClassVar[list] = []

    def __init__(self, conn: redis.Redis, settings) -> None:
        self.settings.append(settings)
        self.stop_event = None

    def run(self) -> None:
        return None


@pytest.mark.parametrize(
    ("flags", "env", "dumps"),
    [
        (["--dump-dir", "/tmp/d"], {}, True),  # the flag asks for dumps
        ([], {"PERSEUS_DUMP_DIR": "/tmp/d"}, False),  # compose sets the folder for every stack
        ([], {"PERSEUS_DUMP_DIR": "/tmp/d", "PERSEUS_DUMP_DATA": "true"}, True),
    ],
)
def test_only_the_dump_flag_or_dump_data_turn_dumps_on(redis_url, monkeypatch, flags, env, dumps):
    monkeypatch.setattr("coordinator.cli.Coordinator", _Seen)
    monkeypatch.setattr("coordinator.cli.signal.signal", lambda *_: None)
    _Seen.settings = []
    code, out = perseus("coordinator", "--redis-url", redis_url, *flags, env=env)
    assert code == 0, out
    (settings,) = _Seen.settings
    assert (settings.dump_data, settings.dump_dir) == (dumps, "/tmp/d")


def test_a_dump_folder_that_cannot_be_written_stops_the_coordinator_at_start(
    redis_url, monkeypatch, tmp_path
):
    # The coordinator started; every dump then failed in an rq worker, logged there only.
    monkeypatch.setattr("coordinator.cli.Coordinator", _Seen)
    monkeypatch.setattr("coordinator.cli.signal.signal", lambda *_: None)
    _Seen.settings = []
    blocker = tmp_path / "file"
    blocker.write_text("x")
    on = {"PERSEUS_DUMP_DATA": "true"}
    for flags, env, said in (
        (["--dump-dir", str(blocker)], {}, f"--dump-dir {blocker} is a file; name a folder"),
        ([], {**on, "PERSEUS_DUMP_DIR": str(blocker / "d")}, f"{blocker} is not a folder"),
        ([], {**on, "PERSEUS_DUMP_DIR": ""}, "PERSEUS_DUMP_DIR is empty while dumps are on"),
    ):
        code, out = perseus("coordinator", "--redis-url", redis_url, *flags, env=env)
        assert code == 2 and said in out and "Traceback" not in out, out
    assert _Seen.settings == []
    with pytest.raises(ConfigError, match=f"dump_dir {blocker} is a file"):
        Coordinator(
            connect(redis_url), make_settings(redis_url, dump_data=True, dump_dir=str(blocker))
        )
    # A relative folder reaches the workers absolute: the one checked here.
    monkeypatch.chdir(tmp_path)
    code, out = perseus("coordinator", "--redis-url", redis_url, "--dump-dir", "dumps")
    assert code == 0, out
    assert _Seen.settings[-1].dump_dir == str(tmp_path / "dumps")


def test_status_shows_rq_suspended_until_resumed(r, redis_url):
    from rq.suspension import resume, suspend

    suspend(r)
    try:
        code, out = perseus("status", "--redis-url", redis_url)
        assert code == 0 and "SUSPENDED (`rq suspend`)" in out
    finally:
        resume(r)
    code, out = perseus("status", "--redis-url", redis_url)
    assert code == 0 and "SUSPENDED" not in out
