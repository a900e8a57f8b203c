"""No password in anything perseus-mq prints or logs: commands, errors, the hook's warnings."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.embedded import EmbeddedRedis
from protocol import keys
from protocol.exceptions import CoordinatorUnavailableError
from protocol.models import JobInfo
from tests.helpers import (
    ROOT,
    TOY_SCHEDULER,
    free_ports,
    make_hook,
    run_step,
    start_perseus,
    stop,
    subprocess_env,
    wait_for,
)
from worker_client.gpu.frequency import DryRunFrequencyController
from worker_client.hook.session import CoordinatorClient

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


def test_commands_never_print_the_password(server):
    url = server.url
    assert PASSWORD in url
    for args in (
        ["status"],
        ["status", "--json"],
        ["deadletter", "list"],
        ["deadletter", "replay", "--all"],
        ["dump", "no-such-job"],
        ["target", "no-such-job", "1.0"],
        ["profile", "no-such-job"],
        ["power-limit", "show", "no-such-workload"],
    ):
        code, out = cli(*args, "--redis-url", url)
        assert clean(out), (args, out)
        # The wrong password fails with a message that names the server, not the password.
        wrong = url.replace(PASSWORD, WRONG)
        code, out = cli(*args, "--redis-url", wrong)
        assert code != 0 and clean(out), (args, out)
        assert "127.0.0.1" in out, (args, out)


@pytest.mark.parametrize("command", ["coordinator", "worker"])
def test_services_log_no_password(server, tmp_path, command):
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", command, "--redis-url", server.url],
        env=subprocess_env(tmp_path),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
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
