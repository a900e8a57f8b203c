"""The Docker side of the compose smoke test: the README's Docker block and a stack to run it."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from tests.helpers import ROOT, wait_for

README_MARK = "<!-- tests/test_compose_docker.py runs the next block -->"
COMPOSE_COMMANDS = {"docker compose": ["docker", "compose"], "docker-compose": ["docker-compose"]}


def readme_commands() -> list[str]:
    """The README's Docker block (the one after README_MARK), comments stripped."""
    text = (ROOT / "README.md").read_text()
    assert text.count(README_MARK) == 1, f"README.md must hold {README_MARK!r} once"
    block = text.split(README_MARK, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [re.sub(r"\s+#\s.*$", "", line).strip() for line in block.splitlines()]
    return [line for line in lines if line]


def docker_unavailable(compose: str) -> str | None:
    """Why the stack cannot run here, or None."""
    if shutil.which("docker") is None:
        return "no docker command on PATH"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        first = (info.stderr.strip().splitlines() or ["no output"])[0]
        return f"no Docker daemon answers (docker info: {first})"
    argv = COMPOSE_COMMANDS[compose]
    if shutil.which(argv[0]) is None:
        return f"`{compose}` is not installed"
    version = subprocess.run([*argv, "version"], capture_output=True, text=True, timeout=60)
    if version.returncode != 0:
        return f"`{compose}` is not installed ({compose} version failed)"
    return None


class Stack:
    """Runs commands in the project copy and keeps a transcript of each with its wall time."""

    def __init__(self, compose: str, project: Path, name: str, transcript: Path) -> None:
        self.compose = COMPOSE_COMMANDS[compose]
        self.project = project
        self.env = {**os.environ, "COMPOSE_PROJECT_NAME": name}
        self.transcript = transcript
        self.started = time.monotonic()

    def note(self, text: str) -> None:
        stamp = time.monotonic() - self.started
        with self.transcript.open("a") as f:
            f.write(f"[{stamp:7.1f} s] {text}\n")

    def run(
        self, argv: list[str], check: bool = True, timeout: float = 900, limit: int = 3000
    ) -> str:
        t0 = time.monotonic()
        proc = subprocess.run(
            argv,
            cwd=self.project,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        out = (proc.stdout + proc.stderr).strip()
        shown = out if len(out) < limit else out[: limit // 2] + "\n...\n" + out[-limit // 2 :]
        self.note(f"$ {shlex.join(argv)}  (rc {proc.returncode}, {time.monotonic() - t0:.1f} s)")
        if shown:
            with self.transcript.open("a") as f:
                f.write("".join(f"    {line}\n" for line in shown.splitlines()))
        if check and proc.returncode != 0:
            raise AssertionError(f"{shlex.join(argv)} failed ({proc.returncode}):\n{out}")
        return proc.stdout

    def shell(self, line: str) -> str:
        return self.run(["bash", "-c", line])

    def dc(self, *args: str, check: bool = True, timeout: float = 900, limit: int = 3000) -> str:
        return self.run([*self.compose, *args], check=check, timeout=timeout, limit=limit)

    def containers(self, service: str) -> list[str]:
        """Ids of the service's running containers."""
        ids = self.dc("ps", "-q", service).split()
        return [i for i in ids if _inspect(i, "{{.State.Running}}") == "true"]

    def wait_healthy(self, service: str, timeout: float = 240) -> None:
        def healthy() -> bool:
            ids = self.containers(service)
            return bool(ids) and all(
                _inspect(i, "{{.State.Health.Status}}") == "healthy" for i in ids
            )

        wait_for(healthy, timeout=timeout, poll=2, what=f"{service} to be healthy")
        self.note(f"{service}: healthy")


def _inspect(container: str, fmt: str) -> str:
    proc = subprocess.run(
        ["docker", "inspect", "-f", fmt, container], capture_output=True, text=True, timeout=60
    )
    return proc.stdout.strip()


def copy_repository(dest: Path) -> None:
    """The files git knows (tracked, or new and not ignored), else all but the usual clutter."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    if listed.returncode != 0:
        clutter = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", ".env")
        shutil.copytree(ROOT, dest, ignore=clutter)
        return
    for rel in filter(None, listed.stdout.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def publish_redis_on_loopback(compose_file: Path) -> None:
    """Uncomment the compose file's opt-in `ports:` lines, as the README tells a user to."""
    text = compose_file.read_text()
    new, count = re.subn(r"(?m)^(\s*)# (ports:|  - \"127\.0\.0\.1:)", r"\1\2", text)
    assert count == 2, "docker-compose.yml: expected the two commented `ports:` lines"
    compose_file.write_text(new)
