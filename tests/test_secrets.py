"""No password in anything perseus-mq prints or logs: commands, errors, the hook's warnings."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator

import click
import pytest
import redis
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.embedded import EmbeddedRedis
from protocol import keys
from protocol.exceptions import CoordinatorUnavailableError
from protocol.models import JobInfo, PowerLimitMeasurement, PowerLimitProfile
from schedulers.planning.synthetic_profile import write_synthetic_profile
from tests.helpers import (
    TOY_SCHEDULER,
    free_ports,
    launch_perseus,
    start_perseus,
    stop,
    subprocess_env,
    wait_for,
)
from tests.rank_helpers import make_hook, run_step
from worker_client.gpu.frequency import DryRunFrequencyController
from worker_client.hook.session import CoordinatorClient
from worker_client.power_limit.profile import save_profile_file

PASSWORD = "pw-5ecret-4711"
WRONG = "pw-wrong-0815"


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    """A Redis that requires a password, on TCP (where a URL carries the password)."""
    with EmbeddedRedis(port=free_ports()[0], password=PASSWORD) as srv:
        yield srv


def clean(text: str) -> bool:
    return PASSWORD not in text and WRONG not in text


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output + (repr(result.exception) if result.exception else "")


# Arguments that make each command that takes --redis-url run once; the services (which keep
# running) are checked by test_services_log_no_password.
COMMAND_ARGS: dict[str, list[list[str]]] = {
    "status": [[], ["--json"]],
    "dump": [["no-such-job"]],
    "profile": [["no-such-job"]],
    "target": [["no-such-job", "1.0"]],
    "deadletter list": [[]],
    "deadletter show": [["9-9"]],
    "deadletter replay": [["--all"]],
    "deadletter purge": [["--all"]],
    "optimize": [["profile.csv", "-s", "2", "-m", "2", "--out", "plans", "--enqueue"]],
    "power-limit show": [["no-such-workload"]],
    "power-limit delete": [["no-such-workload"]],
    "power-limit import": [["profile.json", "w"]],
    "power-limit export": [["no-such-workload", "out.json"]],
    "jobs list": [[], ["--json"]],
    "jobs delete": [["no-such-job"]],
    "jobs finish": [["no-such-job"]],
}
SERVICES = {"coordinator", "worker", "demo"}  # the demo: its wrong-password start below


def redis_commands(group: click.Group, path: tuple[str, ...] = ()) -> list[str]:
    """Every `perseus` command (group members included) that takes --redis-url."""
    found = []
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found += redis_commands(command, (*path, name))
        elif any("--redis-url" in getattr(p, "opts", ()) for p in command.params):
            found.append(" ".join((*path, name)))
    return found


def test_every_command_that_connects_is_checked():
    assert set(redis_commands(main)) == set(COMMAND_ARGS) | SERVICES


def test_commands_never_print_the_password(server, tmp_path, monkeypatch):
    url = server.url
    assert PASSWORD in url
    monkeypatch.chdir(tmp_path)
    write_synthetic_profile(tmp_path / "profile.csv", 2)
    measured = PowerLimitMeasurement(power_limit=300, time=1.0, energy=300.0)
    save_profile_file(PowerLimitProfile(measurements=[measured]), tmp_path / "profile.json")
    runs = [name.split() + args for name, all_args in COMMAND_ARGS.items() for args in all_args]
    for args in runs:
        code, out = cli(*args, "--redis-url", url)
        assert clean(out), (args, out)
        # The wrong password fails with a message that names the server, not the password.
        wrong = url.replace(PASSWORD, WRONG)
        code, out = cli(*args, "--redis-url", wrong)
        assert code != 0 and clean(out), (args, out)
        assert "127.0.0.1" in out, (args, out)
    # The demo runs a whole job: checked where it fails, connecting with a wrong password.
    code, out = cli("demo", "--redis-url", url.replace(PASSWORD, WRONG))
    assert code != 0 and clean(out) and "127.0.0.1" in out, out


@pytest.mark.parametrize("command", ["coordinator", "worker"])
def test_services_log_no_password(server, tmp_path, command):
    proc = launch_perseus(
        [command, "--redis-url", server.url], env=subprocess_env(tmp_path), stderr=subprocess.STDOUT
    )
    conn = redis.Redis.from_url(server.url)
    # Up: the coordinator's consumer group exists, or the worker registered with rq.
    wait_for(
        lambda: conn.exists(keys.REGISTRATIONS_STREAM) or conn.scard("rq:workers"),
        60,
        f"perseus {command} to start",
    )
    proc.terminate()
    out, _ = proc.communicate(timeout=15)
    assert f"perseus {command}: " in out and "redis=redis://:***@127.0.0.1:" in out, out
    assert clean(out), out


def test_hook_errors_and_outage_warnings_carry_no_password(server, gloo, tmp_path, caplog):
    # No coordinator answers: the error that ends up in a training traceback.
    client = CoordinatorClient(server.url, reply_timeout=0.5)
    job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    with pytest.raises(CoordinatorUnavailableError) as caught:
        client.register_job(job, "PointSolution", {})
    assert clean(str(caught.value)) and "127.0.0.1" in str(caught.value)

    # A running hook's warnings while Redis is away.
    services = [
        start_perseus(
            ["coordinator", "--redis-url", server.url, "--scheduler", TOY_SCHEDULER],
            tmp_path,
            "coordinator.log",
        ),
        start_perseus(["worker", "--simple", "--redis-url", server.url], tmp_path, "worker.log"),
    ]
    hook = None
    try:
        with caplog.at_level(logging.DEBUG):
            hook = make_hook(server.url, DryRunFrequencyController(0), report_every=1)
            run_step(hook)
            server.terminate()
            wait_for(lambda: hook.watcher.outage.count, 10, "the watcher to notice")
            run_step(hook)
        assert "unavailable" in caplog.text
        assert clean(caplog.text), caplog.text
    finally:
        if hook is not None:
            hook.close()
        stop(services)
