"""A small `perseus demo` end to end: measured saving matches the planner's prediction."""

from __future__ import annotations

import re
import signal
import subprocess
from typing import Any

import pytest
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.demo import DemoConfig, ProfileWatcher, format_report, run_demo, services
from coordinator.embedded import EmbeddedRedis
from coordinator.health import last_beats
from protocol.connection import connect
from protocol.store import JobStore
from tests.helpers import (
    TOY_SCHEDULER,
    free_ports,
    new_job,
    start_perseus,
    stop,
    wait_for,
)
from tests.pipes import piped


def test_small_demo_saves_what_the_planner_predicts(tmp_path, redis_url, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "gpus"))
    lines: list[str] = []
    config = DemoConfig(
        stages=2,
        microbatches=4,
        redis_url=redis_url,
        out_dir=tmp_path / "out",
        clock_stride=10,
        train_steps=4,
    )
    report = run_demo(config, progress=lines.append)

    assert report.allmax is not None and report.plan is not None
    assert report.plans > 1 and report.predicted_saving_pct > 1.0
    # Energy saving measured in training matches the planner's prediction within 3 points.
    assert abs(report.saving_pct - report.predicted_saving_pct) <= 3.0, format_report(report)
    # The no-slowdown plan is not slower than all-max beyond the planner's rounding.
    slack = report.rounding_s / report.allmax.iteration_time * 100
    assert report.slowdown_pct <= slack, format_report(report)
    assert report.frontier_png is not None and report.frontier_png.read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "out" / "profile.csv").exists()
    assert any("[4/4]" in line for line in lines)
    assert set(report.job_ids) == {"profile", "allmax", "plan"}
    assert re.search(r"\+InstructionProfiler\+demo-profile-[0-9a-f]{8}$", report.job_ids["profile"])


def test_a_second_demo_on_a_served_redis_follows_its_own_job(tmp_path, redis_url, monkeypatch):
    """Run again on a Redis that keeps the first run's jobs and has a coordinator of its own
    (another default scheduler, as the compose stack's): the demo uses that coordinator and
    watches its own profiling job, not the earlier one."""
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "gpus"))
    config = DemoConfig(
        stages=2,
        microbatches=4,
        redis_url=redis_url,
        out_dir=tmp_path / "out",
        clock_stride=16,
        train_steps=2,
    )
    first = run_demo(config, progress=lambda _line: None)
    served = start_perseus(
        ["coordinator", "--redis-url", redis_url, "--scheduler", TOY_SCHEDULER],
        tmp_path,
        "coordinator.log",
    )
    try:
        lines: list[str] = []
        wait_for(lambda: last_beats(connect(redis_url)), timeout=30, what="the coordinator's beat")
        second = run_demo(config, progress=lines.append)
    finally:
        stop([served])
    assert second.job_ids["profile"] != first.job_ids["profile"]
    assert second.plan is not None
    assert any("using the coordinator already running" in line for line in lines), lines


def test_demo_rejects_bad_arguments():
    result = CliRunner().invoke(main, ["demo", "--stages", "1"])
    assert result.exit_code == 2 and "at least 2 stages" in result.output
    result = CliRunner().invoke(main, ["demo", "--microbatches", "0"])
    assert result.exit_code == 2 and "--microbatches" in result.output


def test_a_demo_that_uses_perseus_redis_url_says_so():
    # Exported for the services (README), the variable sent the demo to that Redis unseen.
    handler = signal.getsignal(signal.SIGTERM)
    port = free_ports()[0]
    url = f"redis://:secret@127.0.0.1:{port}/0"
    result = CliRunner().invoke(main, ["demo"], env={"PERSEUS_REDIS_URL": url})
    assert result.exit_code == 1
    first = result.output.splitlines()[0]
    assert "PERSEUS_REDIS_URL" in first and f"127.0.0.1:{port}" in first, result.output
    assert "secret" not in result.output
    assert f"cannot reach Redis at redis://:***@127.0.0.1:{port}/0" in result.output
    # Given on the command line, it is what the user asked for: nothing more said.
    flag = CliRunner().invoke(main, ["demo", "--redis-url", url])
    assert flag.exit_code == 1 and "using the Redis of PERSEUS_REDIS_URL" not in flag.output
    assert f"cannot reach Redis at redis://:***@127.0.0.1:{port}/0" in flag.output
    # Run in-process, the demo leaves this process's SIGTERM handling as it found it.
    assert signal.getsignal(signal.SIGTERM) is handler


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM", "SIGHUP"])
def test_ctrl_c_shuts_everything_down(tmp_path, how):
    """Ctrl-C (SIGINT to the terminal's process group) mid-profiling leaves nothing running.

    So does SIGTERM to the demo's process alone (kill, timeout), and SIGHUP (its terminal
    closed): each used to end the demo at once, leaving its private Redis, rq worker and ranks
    running.
    """
    import contextlib
    import os
    import re
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(
        os.environ,
        PYTHONPATH=str(root),
        PERSEUS_SIM_GPU_DIR=str(tmp_path / "gpus"),
        PYTHONUNBUFFERED="1",
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "demo",
            "--stages",
            "2",
            "--microbatches",
            "2",
            "--out",
            str(tmp_path / "out"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, like a job in a terminal
    )
    try:
        with piped(proc) as out:
            lines = [out.readline(300)]
            while lines[-1] and not lines[-1].startswith("[1/4]"):
                lines.append(out.readline(300))
            match = re.search(r"unix://(\S+)/redis\.sock", "".join(lines))
            assert match, lines
            redis_dir = match.group(1)
            time.sleep(2)  # ranks, coordinator and worker are busy profiling
            if how == "Ctrl-C":
                os.killpg(proc.pid, signal.SIGINT)
            else:  # SIGHUP: the terminal closed
                proc.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGHUP)
            output = out.rest(60)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):  # nothing of it outlives a failure
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 1 and "Aborted!" in output, output
    assert "Traceback" not in output, output

    def leftovers() -> list[str]:
        found = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if redis_dir in cmdline:
                found.append(cmdline)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 0)
            found.append(f"process group {proc.pid} still has members")
        return found

    deadline = time.monotonic() + 10
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers() == []  # Redis, the rq worker and every rank are gone
    assert not Path(redis_dir).exists()


def test_the_profiling_watcher_stops_the_demo_when_no_coordinator_is_left(r, tmp_path):
    # A borrowed coordinator that went away would leave the profiling job running for minutes.
    store = JobStore(r)
    new_job(store, "2026-11-26-00-00-00.000+dp1+pp2+tp1+InstructionProfiler+demo-profile-ab", "x")
    stop_file = tmp_path / "profiled"
    watcher = ProfileWatcher(store, stop_file, lambda _line: None, "+demo-profile-ab")
    watcher.start()
    wait_for(stop_file.exists, timeout=10, what="the stop file")
    watcher.stop()
    assert watcher.error == "no coordinator is running on this Redis any more"


def test_a_signal_in_the_services_clean_up_still_stops_the_private_redis(monkeypatch):
    # A SIGTERM or second Ctrl-C landing in the wait for the rq worker skipped the rest of
    # the clean-up: the private Redis (a session of its own) was left running.
    started: list[EmbeddedRedis] = []
    real_init = EmbeddedRedis.__init__

    def remember(self: EmbeddedRedis, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        started.append(self)

    def interrupted(self: subprocess.Popen, timeout: float | None = None) -> int:
        monkeypatch.undo()  # once: later waits (Redis's own stop) are real
        raise KeyboardInterrupt

    monkeypatch.setattr(EmbeddedRedis, "__init__", remember)
    with pytest.raises(KeyboardInterrupt), services(None, lambda _: None):
        monkeypatch.setattr(subprocess.Popen, "wait", interrupted)
    (server,) = started
    assert server._proc.poll() is not None, "the private Redis was left running"
