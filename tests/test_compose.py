"""The compose file's services and commands match the CLI (no Docker engine needed)."""

from __future__ import annotations

from pathlib import Path

import click
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
        assert env["PERSEUS_REDIS_URL"].startswith("redis://redis:6379")
        # Every PERSEUS_ variable is a settings field (the settings forbid unknown ones).
        from coordinator.settings import PerseusSettings

        for var in env:
            assert var.removeprefix("PERSEUS_").lower() in PerseusSettings.model_fields, var
    # The scheduler arguments are JSON once compose fills in the plan path.
    import json
    import re

    raw = services["coordinator"]["environment"]["PERSEUS_SCHEDULER_ARGS"]
    filled = re.sub(r"\$\{PERSEUS_PLAN:-([^}]*)\}", r"\1", raw)
    assert json.loads(filled) == {"solution_path": "/plans/plan.py"}


def test_dockerfile_installs_the_console_script():
    text = (ROOT / "Dockerfile").read_text()
    instructions = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert any("pip install ." in line for line in instructions)
    # The services need no torch (a CUDA build from PyPI would add gigabytes to the image).
    assert not any("torch" in line for line in instructions)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'perseus = "coordinator.cli:main"' in pyproject
