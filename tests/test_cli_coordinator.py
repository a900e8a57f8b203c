"""`perseus coordinator` at its start: scheduler settings, refusals and the dump settings."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import ClassVar

import pytest
import redis

from coordinator.service import Coordinator
from protocol.connection import connect
from protocol.exceptions import ConfigError
from tests.helpers import invoke_perseus, launch_perseus, make_settings, subprocess_env
from tests.pipes import piped


def first_line(args: list[str], tmp_path: Path, variables: dict[str, str]) -> tuple[str, bool, str]:
    """Start ``perseus ARGS`` (``variables`` set), read its first line, then stop it (SIGTERM).

    Returns:
        That line, whether it still ran after printing it, and what it printed afterwards.
    """
    env = subprocess_env(tmp_path, **variables)
    with piped(launch_perseus(args, env=env, stderr=subprocess.STDOUT)) as output:
        first = output.readline(60)
        ran_on = output.proc.poll() is None
        output.proc.terminate()
        rest = output.rest(60)
    return first, ran_on, rest


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
    code, out = invoke_perseus("coordinator", "--redis-url", redis_url, *args)
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
    code, out = invoke_perseus("coordinator", "--redis-url", redis_url, env=variables)
    assert code == 2, out
    offered = next(line for line in out.splitlines() if "(no default" in line)
    argv = shlex.split(offered.split("(no default")[0])
    assert argv[:2] == ["perseus", "coordinator"], offered
    # The start line, or a refusal's "Usage:".
    first, _, rest = first_line([*argv[1:], "--redis-url", redis_url], tmp_path, variables)
    assert first.startswith("perseus coordinator: scheduler=none (each job"), first + rest


def test_a_missing_plan_from_perseus_plan_is_told_to_fix_perseus_plan(redis_url):
    # The compose stack's default: PointSolution3D with PERSEUS_PLAN=/plans/plan.py. The advice
    # was the CLI's --scheduler-args, which has no place in a compose file.
    env = {"PERSEUS_SCHEDULER": "PointSolution3D", "PERSEUS_PLAN": "/no/plans/plan.py"}
    code, out = invoke_perseus("coordinator", "--redis-url", redis_url, env=env)
    assert code == 2, out
    assert "/no/plans/plan.py: plan file not found" in out
    assert (
        "set PERSEUS_PLAN to an existing plan file (under docker compose: put it at "
        "./plans/plan.py" in " ".join(out.split())
    ), out
    assert '--scheduler-args \'{"solution_path"' not in out, out
    # With no default the plan is not used: no --scheduler-args to clear.
    assert "perseus coordinator --scheduler ''   (no default" in out, out


def test_an_unknown_scheduler_name_is_answered_with_the_nearest(redis_url):
    code, out = invoke_perseus(
        "coordinator", "--redis-url", redis_url, "--scheduler", "PointSoluton"
    )
    assert code == 2, out
    assert "unknown scheduler 'PointSoluton' (did you mean PointSolution?)" in out, out


def test_schedulers_lists_each_argument_with_its_type_and_default():
    code, out = invoke_perseus("schedulers")
    assert code == 0, out
    lines = [line.strip() for line in out.splitlines()]
    profiler = lines[lines.index("InstructionProfiler") :]
    assert "microbatches: int (required)" in profiler, out
    assert "stop_after_rises: int = 5" in profiler, out
    assert "frequencies: list[int] | None = None" in profiler, out
    assert "policy: str = 'no-slowdown'" in lines, out


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
    code, out = invoke_perseus("coordinator", "--redis-url", redis_url, *flags, env=env)
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
        code, out = invoke_perseus("coordinator", "--redis-url", redis_url, *flags, env=env)
        assert code == 2 and said in out and "Traceback" not in out, out
    assert _Seen.settings == []
    with pytest.raises(ConfigError, match=f"dump_dir {blocker} is a file"):
        Coordinator(
            connect(redis_url), make_settings(redis_url, dump_data=True, dump_dir=str(blocker))
        )
    # A relative folder reaches the workers absolute: the one checked here.
    monkeypatch.chdir(tmp_path)
    code, out = invoke_perseus("coordinator", "--redis-url", redis_url, "--dump-dir", "dumps")
    assert code == 0, out
    assert _Seen.settings[-1].dump_dir == str(tmp_path / "dumps")
