"""The compose file's services and commands match the CLI (no Docker engine needed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import click
import pytest
import yaml

from coordinator.cli import main

ROOT = Path(__file__).resolve().parent.parent


def load() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_and_persistence():
    compose = load()
    services = compose["services"]
    assert set(services) == {"redis", "coordinator", "worker"}
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    assert "redis-data" in compose["volumes"]
    # One image, built from the repo's Dockerfile, serves both perseus services.
    assert services["coordinator"]["build"] == "."
    assert (ROOT / "Dockerfile").exists()
    assert services["coordinator"]["image"] == services["worker"]["image"]
    # The worker service has no fixed name or port, so `--scale worker=N` works.
    assert "container_name" not in services["worker"] and "ports" not in services["worker"]


def test_commands_are_real_cli_commands():
    services = load()["services"]
    for name in ("coordinator", "worker"):
        command = services[name]["command"]
        assert command[0] == "perseus"
        sub = main.get_command(click.Context(main), command[1])
        assert sub is not None, f"{name}: no such command {command[1]}"
        sub.make_context(command[1], list(command[2:]))  # options parse
        env = services[name]["environment"]
        # The password comes from .env (compose refuses to start without it).
        assert env["PERSEUS_REDIS_URL"] == "redis://:${PERSEUS_REDIS_PASSWORD}@redis:6379/0"
        # Every PERSEUS_ variable is a settings field (the settings forbid unknown ones).
        from coordinator.settings import PerseusSettings

        for var in env:
            assert var.removeprefix("PERSEUS_").lower() in PerseusSettings.model_fields, var
    # The scheduler's arguments come from .env (env_file) alone: the compose file names the
    # plan, which the coordinator uses when they are not set (tests/test_compose_env.py).
    coordinator_env = services["coordinator"]["environment"]
    assert "PERSEUS_SCHEDULER_ARGS" not in coordinator_env
    assert coordinator_env["PERSEUS_PLAN"] == "${PERSEUS_PLAN:-/plans/plan.py}"


def test_perseus_services_read_dot_env_and_run_under_an_init():
    services = load()["services"]
    for name in ("coordinator", "worker"):
        # Every PERSEUS_* line of .env reaches the service (not only those named here).
        assert services[name]["env_file"] == ".env", name
        # A SIGTERM in a perseus process's first seconds, before its handlers, was ignored
        # while it was PID 1: `docker compose stop` waited its 10 s and killed it.
        assert services[name]["init"] is True, name


def test_dockerfile_installs_the_console_script():
    text = (ROOT / "Dockerfile").read_text()
    instructions = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    # The project itself, after its dependencies (from pyproject.toml) in a layer of their own.
    assert any("pip install --no-deps /src" in line for line in instructions)
    assert any("pip install -r /tmp/requirements.txt" in line for line in instructions)
    # The services need no torch (a CUDA build from PyPI would add gigabytes to the image).
    assert not any("torch" in line for line in instructions)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'perseus = "coordinator.cli:main"' in pyproject


def test_redis_is_locked_down():
    compose = load()
    redis_service = compose["services"]["redis"]
    # Not published by default; the opt-in mapping (commented out) binds loopback only.
    assert "ports" not in redis_service
    text = (ROOT / "docker-compose.yml").read_text()
    commented = [line.strip() for line in text.splitlines() if "127.0.0.1:" in line]
    assert commented == ['#   - "127.0.0.1:${PERSEUS_REDIS_PORT:-6379}:6379"']
    assert "0.0.0.0" not in text.replace("never 0.0.0.0", "")
    command = redis_service["command"]
    password = command[command.index("--requirepass") + 1]
    assert password.startswith("${PERSEUS_REDIS_PASSWORD:?"), "required, with a message"
    # redis-cli in the container (healthcheck, README's `exec redis redis-cli`) logs in.
    assert redis_service["environment"]["REDISCLI_AUTH"] == "${PERSEUS_REDIS_PASSWORD}"
    # The compose-only variables are known, so `perseus` does not call them typos.
    from coordinator.settings import unknown_variables

    assert unknown_variables({"PERSEUS_REDIS_PASSWORD": "x", "PERSEUS_REDIS_PORT": "1"}) == []


def test_coordinator_healthcheck_and_writable_dump_volume():
    compose = load()
    coordinator = compose["services"]["coordinator"]
    test = coordinator["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "coordinator.health"]
    from coordinator.health import main as health_main

    with pytest.raises(SystemExit) as exc:  # its options parse
        health_main([*test[4:], "--help"])
    assert exc.value.code == 0
    # Dumps go to a named volume: Docker creates it owned like the image's /dump (the service
    # user's), where a bind-mounted ./dump that Docker creates would be root's.
    for name in ("coordinator", "worker"):
        assert "dump:/dump" in compose["services"][name]["volumes"]
    assert "dump" in compose["volumes"]
    assert coordinator["environment"]["PERSEUS_DUMP_DIR"] == "/dump"


def test_image_runs_as_its_user_with_writable_dirs():
    lines = [
        line.strip()
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert lines[-1] == "USER perseus"
    text = "\n".join(lines)
    assert "chown perseus:perseus /work /dump" in text
    assert "WORKDIR /work" in text
    # Nothing but the package index: no URL in any instruction.
    assert "http" not in text


def test_dockerignore_lets_in_only_the_package():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*"
    allowed = {p.lstrip("!").rstrip("/") for p in patterns if p.startswith("!")}
    assert allowed == {
        "pyproject.toml",
        "README.md",
        "protocol",
        "coordinator",
        "worker_client",
        "schedulers",
    }
    # Exactly the packages pyproject.toml installs.
    include = re.search(r"include = \[([^\]]*)\]", (ROOT / "pyproject.toml").read_text()).group(1)
    packages = {p.strip().strip('"').rstrip("*") for p in include.split(",")}
    assert packages == allowed - {"pyproject.toml", "README.md"}


@pytest.mark.parametrize("compose", ["docker compose", "docker-compose"])
def test_compose_config_validates(compose, tmp_path):
    """The compose tool's own schema check passes, and refuses to run without the password."""
    argv = compose.split()
    if shutil.which(argv[0]) is None:
        pytest.skip(f"`{compose}` is not installed")
    if subprocess.run([*argv, "version"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip(f"`{compose}` is not installed")
    # A project of its own: the services' env_file is the .env beside the compose file.
    shutil.copy(ROOT / "docker-compose.yml", tmp_path / "docker-compose.yml")
    (tmp_path / ".env").write_text("")
    empty = tmp_path / "empty.env"
    empty.write_text("")
    base = [*argv, "--env-file", str(empty), "-f", str(tmp_path / "docker-compose.yml"), "config"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSEUS_")}

    def config(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            base, env={**env, **extra}, capture_output=True, text=True, timeout=120, cwd=tmp_path
        )

    ok = config(PERSEUS_REDIS_PASSWORD="0123abcd")
    assert ok.returncode == 0, ok.stderr
    rendered = yaml.safe_load(ok.stdout)
    assert "0123abcd" in rendered["services"]["redis"]["command"]
    missing = config()
    assert missing.returncode != 0
    assert "set PERSEUS_REDIS_PASSWORD in .env" in missing.stderr
