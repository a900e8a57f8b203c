"""What a `.env` next to docker-compose.yml does to the services, worked out without Docker.

The containers' environments are built here as compose builds them (the ``env_file`` first,
then ``environment:`` interpolated from the shell and ``.env``, in docker-compose v1's syntax,
which v2 also reads); the coordinator then starts for real in a process with that
environment, on the test's Redis instead of the stack's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.cli_common import load_settings
from coordinator.settings import unknown_variables
from protocol.exceptions import ConfigError
from tests.helpers import ROOT, TOY_SCHEDULER, make_settings
from tests.pipes import piped
from tests.rank_helpers import write_1f1b_plan

PASSWORD = "0123abcd"
# docker-compose v1's interpolation: no nesting, and a default cannot hold "}".
_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|(?P<named>[_A-Za-z][_A-Za-z0-9]*)"
    r"|\{(?P<braced>[_A-Za-z][_A-Za-z0-9]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\})"
)


def interpolate(text: str, variables: dict[str, str]) -> str:
    """``text`` with compose's ``$VAR``, ``${VAR}``, ``${VAR:-x}``, ``${VAR-x}``, ``${VAR?e}``."""

    def one(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["named"] or match["braced"]
        value, op, arg = variables.get(name), match["op"], match["arg"]
        if op in (":-", ":?") and not value:
            value = None
        if value is not None:
            return value
        if op and op.endswith("?"):
            raise ValueError(f"compose refuses to start: {arg}")
        return arg if op else ""

    return _VARIABLE.sub(one, text)


def read_env_file(path: Path) -> dict[str, str]:
    """A dotenv file as compose reads one (comments, blank lines, quoted values)."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.removeprefix("export ").partition("=")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name.strip()] = value
    return values


def container_env(service: str, project: Path, shell: dict[str, str]) -> dict[str, str]:
    """The environment compose gives ``service``'s container, ``project/.env`` beside it."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    spec: dict[str, Any] = compose["services"][service]
    dotenv = read_env_file(project / ".env")
    variables = {**dotenv, **shell}  # the shell wins over .env
    env: dict[str, str] = {}
    files = spec.get("env_file", [])
    for name in [files] if isinstance(files, str) else files:
        env.update(read_env_file(project / name))  # not interpolated
    for name, value in spec.get("environment", {}).items():
        env[name] = interpolate(str(value), variables)
    return env


def start_coordinator(env: dict[str, str], redis_url: str, tmp_path: Path) -> str:
    """Start `perseus coordinator` with ``env`` alone (on ``redis_url``); its first output.

    Returns the start line, or the refusal, once the process has printed it.
    """
    base = {k: v for k, v in os.environ.items() if not k.startswith("PERSEUS_")}
    proc_env = {**base, **env, "PERSEUS_REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", *_command("coordinator")[1:]],
        env=proc_env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    with piped(proc) as output:
        first = output.readline(60)
        if first.startswith("perseus coordinator:"):  # started: it would run until stopped
            proc.terminate()
        return first + output.rest(60)


def _command(service: str) -> list[str]:
    return list(
        yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"][service]["command"]
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A compose project folder with a plan where the stack's /plans/plan.py would be."""
    write_1f1b_plan(tmp_path / "plan.py", 2, 2, [(1980, 1950), (1905, 1890)])
    return tmp_path


def write_env(project: Path, *lines: str) -> None:
    (project / ".env").write_text("\n".join([f"PERSEUS_REDIS_PASSWORD={PASSWORD}", *lines]) + "\n")


def test_any_setting_in_dot_env_reaches_both_services(project):
    # Only the five variables the compose file named reached the containers: a
    # PERSEUS_STALL_TIMEOUT in .env did nothing, unsaid.
    write_env(project, "PERSEUS_STALL_TIMEOUT=30", "PERSEUS_JOB_TIMEOUT=600")
    for service in ("coordinator", "worker"):
        env = container_env(service, project, {})
        assert env["PERSEUS_STALL_TIMEOUT"] == "30", service
        assert env["PERSEUS_JOB_TIMEOUT"] == "600", service
        # What the compose file fixes is its own, whatever .env says.
        assert env["PERSEUS_REDIS_URL"] == f"redis://:{PASSWORD}@redis:6379/0"


def test_settings_from_dot_env_are_the_coordinators(project, redis_url, monkeypatch):
    write_env(project, "PERSEUS_STALL_TIMEOUT=30", f"PERSEUS_PLAN={project / 'plan.py'}")
    for name in [n for n in os.environ if n.startswith("PERSEUS_")]:
        monkeypatch.delenv(name)
    for name, value in {
        **container_env("coordinator", project, {}),
        "PERSEUS_REDIS_URL": redis_url,
    }.items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    assert settings.stall_timeout == 30.0
    settings.check_scheduler()
    assert settings.scheduler == "PointSolution3D"
    assert settings.scheduler_args == {"solution_path": str(project / "plan.py")}


def test_an_empty_scheduler_in_dot_env_is_no_default_scheduler(project, redis_url):
    # ${PERSEUS_SCHEDULER:-PointSolution3D} made an empty one PointSolution3D again, with the
    # plan's arguments: "no default, each job names its own" could not be set from .env.
    write_env(project, "PERSEUS_SCHEDULER=")
    env = container_env("coordinator", project, {})
    assert env["PERSEUS_SCHEDULER"] == ""
    out = start_coordinator(env, redis_url, project)
    assert out.startswith("perseus coordinator: scheduler=none (each job"), out
    # The compose file's PERSEUS_PLAN is still set: said to be unused, not silently dropped.
    assert "plan=/plans/plan.py is not used: with no default scheduler" in out, out


def test_scheduler_args_in_dot_env_are_not_overridden(project, redis_url):
    # The compose file set PERSEUS_SCHEDULER_ARGS itself (the stack's /plans/plan.py): other
    # arguments in .env never reached the coordinator ("edit the compose file").
    args = json.dumps({"solution_path": str(project / "plan.py")})
    write_env(project, "PERSEUS_SCHEDULER=PointSolution", f"PERSEUS_SCHEDULER_ARGS='{args}'")
    env = container_env("coordinator", project, {})
    assert json.loads(env["PERSEUS_SCHEDULER_ARGS"]) == {"solution_path": str(project / "plan.py")}
    out = start_coordinator(env, redis_url, project)
    assert out.startswith("perseus coordinator: scheduler=PointSolution "), out


def test_the_default_stack_serves_the_plan_and_the_shell_overrides_dot_env(project, redis_url):
    write_env(project, f"PERSEUS_PLAN={project / 'plan.py'}", "PERSEUS_LOG_LEVEL=WARNING")
    env = container_env("coordinator", project, {"PERSEUS_LOG_LEVEL": "DEBUG"})
    assert env["PERSEUS_LOG_LEVEL"] == "DEBUG"
    out = start_coordinator(env, redis_url, project)
    assert out.startswith("perseus coordinator: scheduler=PointSolution3D "), out
    # Without PERSEUS_PLAN: the stack's own /plans/plan.py, which this machine does not have.
    write_env(project)
    env = container_env("coordinator", project, {})
    assert env["PERSEUS_PLAN"] == "/plans/plan.py" and env["PERSEUS_SCHEDULER"] == "PointSolution3D"
    out = start_coordinator(env, redis_url, project)
    assert "/plans/plan.py: plan file not found" in out, out


def test_a_misspelt_setting_in_dot_env_stops_the_service_naming_it(project, redis_url):
    write_env(project, "PERSEUS_STAL_TIMEOUT=30")
    env = container_env("coordinator", project, {})
    out = start_coordinator(env, redis_url, project)
    assert "unknown environment variable PERSEUS_STAL_TIMEOUT" in out, out
    assert "did you mean PERSEUS_STALL_TIMEOUT?" in out, out


def test_compose_only_variables_in_dot_env_are_known_to_the_services(project):
    write_env(project, "PERSEUS_REDIS_PORT=6390", "PERSEUS_PLAN=/plans/x.py")
    for service in ("coordinator", "worker"):
        assert unknown_variables(container_env(service, project, {})) == [], service


def test_the_plan_is_used_only_by_a_scheduler_that_takes_one_without_arguments(project):
    plan = str(project / "plan.py")
    settings = make_settings("redis://x", scheduler="PointSolution3D", scheduler_args={}, plan=plan)
    settings.check_scheduler()
    assert settings.scheduler_args == {"solution_path": plan}
    # Arguments given win; a scheduler without a solution_path, or none, leaves the plan alone.
    given = {"plan_text": (project / "plan.py").read_text()}
    for scheduler, args, expected in (
        ("PointSolution", given, given),
        (TOY_SCHEDULER, {}, {}),
        ("", {}, {}),
    ):
        settings = make_settings("redis://x", scheduler=scheduler, scheduler_args=args, plan=plan)
        settings.check_scheduler()
        assert settings.scheduler_args == expected, scheduler


def test_a_plan_passed_over_for_other_arguments_is_named_in_the_error(project):
    # PointSolution with arguments but neither plan: "got neither" alone read as if
    # PERSEUS_PLAN were missing, though it was set (it fills empty arguments only).
    plan = str(project / "plan.py")
    settings = make_settings(
        "redis://x", scheduler="PointSolution", scheduler_args={"plan_text": None}, plan=plan
    )
    with pytest.raises(ConfigError) as info:
        settings.check_scheduler()
    words = str(info.value)
    assert "neither" in words and f"plan={plan!r} is not used" in words, words


def test_a_plan_a_scheduler_cannot_take_is_named_in_its_error(project):
    # PERSEUS_SCHEDULER=FrontierScheduler beside a PERSEUS_PLAN read "got neither" only,
    # as if the plan had not been set: the scheduler takes no solution_path.
    plan = str(project / "plan.py")
    settings = make_settings(
        "redis://x", scheduler="FrontierScheduler", scheduler_args={}, plan=plan
    )
    with pytest.raises(ConfigError) as info:
        settings.check_scheduler()
    words = str(info.value)
    assert "got neither" in words, words
    assert f"plan={plan!r} is not used: FrontierScheduler takes no solution_path" in words, words
