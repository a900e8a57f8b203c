"""`docker compose up` for real: the README's Docker commands, jobs from the host, and faults.

Runs the README's Docker block, line by line, in a copy of the repository, with whichever of
`docker compose` and `docker-compose` exist. Between those lines it runs 4-rank jobs (gloo,
dry-run clocks) from this host through the loopback port, kills a worker and restarts Redis
while a job runs, and checks that nothing was lost. Skipped, with the reason, where no Docker
daemon answers. It builds the image (minutes the first time), so run it on its own:

    python -m pytest -q -s tests/test_compose_docker.py

tests/compose_stack.py reads the README's block and runs the compose commands; this module holds
what runs between them.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from rq import Worker
from rq.exceptions import NoSuchJobError
from rq.job import Job

from protocol import keys
from protocol.store import JobStore
from schedulers.planning.plan_file import read_plan_file
from schedulers.planning.synthetic_profile import write_synthetic_profile
from tests.compose_stack import (
    COMPOSE_COMMANDS,
    Stack,
    copy_repository,
    docker_unavailable,
    publish_redis_on_loopback,
    readme_commands,
)
from tests.helpers import free_ports, planner_cli, wait_for
from tests.rank_helpers import collect_ranks, spawn_ranks

PP, MICROBATCHES = 4, 4
PLAN_STEPS = 6
# The fault job: the InstructionProfiler sweeps these clocks, one version per clock, and never
# stops early, so versions keep coming while the faults happen.
# Long enough (about a version per 0.5 s) that the sweep outlasts catching a busy worker (up
# to 20 s), the kill and the Redis restart: with 16 clocks it could end before the kill.
SWEEP = [1980 - 15 * i for i in range(80)]
FAULT_STEPS, STEP_SLEEP = 300, 0.2


class PublishedSchedules(threading.Thread):
    """Every version's schedules, read as it is published: Redis keeps only the newest few.

    Polls the job's version and survives Redis restarts (it retries until stopped).
    """

    def __init__(self, url: str, job_id: str) -> None:
        super().__init__(name="published-schedules", daemon=True)
        self.url, self.job_id = url, job_id
        self.schedules: dict[int, dict[int, list[int]]] = {}
        self.missed: list[int] = []  # versions already deleted when first looked for
        self.stop = threading.Event()

    def run(self) -> None:
        store = JobStore(redis.Redis.from_url(self.url, socket_timeout=5))
        seen = 0
        while not self.stop.wait(0.05):
            try:
                latest = store.version(self.job_id)
                for version in range(seen + 1, latest + 1):
                    got = store.schedules(self.job_id, version)
                    if got:
                        self.schedules[version] = {
                            s.rank: [f for _, f in s.frequencies] for s in got
                        }
                    else:
                        self.missed.append(version)
                    seen = version
            except redis.RedisError:
                continue


def connect_host(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)


def quiet(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with Redis errors (a restarting server) read as 'not yet'."""

    def call() -> Any:
        try:
            return fn()
        except redis.RedisError:
            return None

    return call


def find_job(store: JobStore, meta: str) -> str | None:
    return next((job for job, _ in store.list_jobs() if job.endswith(f"+{meta}")), None)


def version_of_step(record: dict, step: int) -> int:
    """The schedule version a rank ran ``step`` (0-based) on, from its swaps."""
    version = record["first_version"]
    for at, v in record["swaps"]:
        if at <= step:
            version = v
    return version


class SmokeRun:
    """What runs between the README's commands: jobs from the host, checks, faults."""

    def __init__(self, stack: Stack, out: Path) -> None:
        self.stack = stack
        self.out = out
        # What `perseus demo` leaves in the folder, for this test's pipeline: the frontier the
        # README's `perseus choose perseus-demo/frontier ... --copy-to plans/plan.py` reads.
        profile = write_synthetic_profile(out / "profile.csv", PP, stride=12)
        frontier = stack.project / "perseus-demo" / "frontier"
        argv = ["optimize", str(profile), "-s", str(PP), "-m", str(MICROBATCHES)]
        res = CliRunner().invoke(planner_cli(), [*argv, "--out", str(frontier)])
        assert res.exit_code == 0, res.output
        self.plan_stages: list[list[tuple[str, int]]] = []
        self.url = ""
        self.plan_job = ""
        self.done: list[str] = []

    # --- after the README's commands ------------------------------------------------------------
    def after_plan_choice(self) -> None:
        plan = read_plan_file(self.stack.project / "plans" / "plan.py")
        assert (plan.num_stages, plan.num_microbatches) == (PP, MICROBATCHES), plan.source
        self.plan_stages = plan.stages
        self.stack.note(f"plans/plan.py: {plan.header.get('plan', '?')} of the frontier")

    def after_env_file(self) -> None:
        env_file = self.stack.project / ".env"
        values = dict(line.split("=", 1) for line in env_file.read_text().split())
        password = values["PERSEUS_REDIS_PASSWORD"]
        assert re.fullmatch(r"[0-9a-f]{48}", password), "the README's password is 48 hex digits"
        (port,) = free_ports()  # 6379 may be taken on this host (it is on the project's machines)
        with env_file.open("a") as f:
            f.write(f"PERSEUS_REDIS_PORT={port}\n")
        self.url = f"redis://:{password}@127.0.0.1:{port}/0"
        self.stack.note(f"Redis for the host: redis://:***@127.0.0.1:{port}/0")

    def after_up(self, output: str) -> None:
        for service in ("redis", "coordinator"):
            self.stack.wait_healthy(service)
        self.check_locked_down()
        self.run_plan_job()

    def after_ps(self, output: str) -> None:
        for service in ("redis", "coordinator"):
            lines = [
                line
                for line in output.splitlines()
                if f"_{service}_" in line or f"-{service}-" in line
            ]
            assert lines and all("healthy" in line and "unhealthy" not in line for line in lines), (
                output
            )

    def after_status(self, output: str) -> None:
        assert self.plan_job in output, output
        assert "workers=1" in output, output

    def after_rq_info(self, output: str) -> None:
        # rq's own view, through the URL the container has (rq reads no PERSEUS_REDIS_URL).
        assert "1 workers, " in output and keys.RQ_QUEUE in output, output

    def after_xinfo(self, output: str) -> None:
        words = output.split()
        fields = dict(zip(words[::2], words[1::2], strict=False))
        assert fields.get("name") == keys.COORDINATOR_GROUP, output
        assert fields.get("pending") == "0", output  # every result of the plan job was handled

    def after_scale(self, output: str) -> None:
        conn = connect_host(self.url)
        wait_for(
            lambda: len(self.stack.containers("worker")) == 3, timeout=180, poll=2, what="3 workers"
        )
        wait_for(
            lambda: len(Worker.all(connection=conn)) >= 3, timeout=120, poll=1, what="3 rq workers"
        )
        self.run_fault_job(conn)

    def after_down(self, output: str) -> None:
        assert self.stack.dc("ps", "-q").strip() == ""
        name = self.stack.env["COMPOSE_PROJECT_NAME"]
        volumes = self.stack.run(["docker", "volume", "ls", "-q", "--filter", f"name={name}"])
        assert volumes.strip() == "", f"volumes left after down -v: {volumes}"

    # --- checks and jobs ------------------------------------------------------------------------
    def check_locked_down(self) -> None:
        """Redis wants the password and is published on loopback only; the image as designed."""
        host_port = self.url.rsplit(":", 1)[1].split("/")[0]
        no_password = redis.Redis(host="127.0.0.1", port=int(host_port), socket_timeout=10)
        with pytest.raises(redis.AuthenticationError):
            no_password.ping()
        (redis_id,) = self.stack.containers("redis")
        published = self.stack.run(["docker", "port", redis_id])
        assert published.strip() and all(
            line.endswith(f"127.0.0.1:{host_port}") for line in published.strip().splitlines()
        ), published
        probe = (
            "import importlib.util, os; "
            "assert importlib.util.find_spec('torch') is None, 'torch in the image'; "
            "assert os.getuid() != 0, 'runs as root'; "
            "[open(os.path.join(d, '.probe'), 'w').close() for d in ('/work', '/dump', '.')]; "
            "print('uid', os.getuid(), 'cwd', os.getcwd())"
        )
        self.stack.dc("exec", "-T", "coordinator", "python", "-c", probe)

    def run_plan_job(self) -> None:
        """A 4-rank job on the coordinator's default scheduler: the plan in ./plans."""
        stages = self.plan_stages
        procs = spawn_ranks(4, PP, self.url, self.out, "plan", PLAN_STEPS, MICROBATCHES)
        records = collect_ranks(procs, self.out, "plan", timeout=300)
        (job_id,) = {rec["job_id"] for rec in records}
        assert "+PointSolution3D+plan" in job_id
        for rec in records:
            planned = [f for _, f in stages[rec["pp_rank"]]]
            assert rec["frequencies"] == planned * PLAN_STEPS, f"rank {rec['rank']}"
        self.plan_job = job_id
        conn = connect_host(self.url)
        assert sorted(r.rank for r in JobStore(conn).results(job_id, 1)) == [0, 1, 2, 3]
        self.stack.note(
            f"plan job {job_id}: every rank ran the plan's clocks for {PLAN_STEPS} steps"
        )

    def run_fault_job(self, conn: redis.Redis) -> None:
        """Kill a worker and restart Redis while a job sweeps clocks; nothing may be lost."""
        store = JobStore(conn)
        args = {"microbatches": MICROBATCHES, "frequencies": SWEEP, "stop_after_rises": 1000}
        procs = spawn_ranks(
            4,
            2,
            self.url,
            self.out,
            "faults",
            FAULT_STEPS,
            MICROBATCHES,
            scheduler="InstructionProfiler",
            scheduler_args=args,
            step_sleep=STEP_SLEEP,
        )
        job_id = wait_for(quiet(lambda: find_job(store, "faults")), timeout=120, what="the job")
        recorder = PublishedSchedules(self.url, job_id)
        recorder.start()
        wait_for(quiet(lambda: store.version(job_id) >= 2), timeout=120, what="version 2")

        victim, doing = self.pick_busy_worker(conn)
        at_kill = store.version(job_id)
        self.stack.run(["docker", "kill", victim])
        self.stack.note(f"killed worker {victim[:12]} at version {at_kill} (its rq job: {doing})")
        wait_for(
            quiet(lambda: store.version(job_id) > at_kill),
            timeout=120,
            poll=0.5,
            what="a version after the kill",
        )

        at_restart = store.version(job_id)
        self.stack.dc("restart", "redis")
        self.stack.note(f"restarted redis at version {at_restart}")
        self.stack.wait_healthy("redis")
        wait_for(
            quiet(lambda: store.version(job_id) > at_restart),
            timeout=180,
            poll=0.5,
            what="a version after the Redis restart",
        )
        self.stack.note(f"version {store.version(job_id)} after the restart")

        records = collect_ranks(procs, self.out, "faults", timeout=600)
        recorder.stop.set()
        recorder.join(timeout=10)
        self.check_fault_job(store, job_id, records, recorder)

    def pick_busy_worker(self, conn: redis.Redis) -> tuple[str, str]:
        """A worker container holding an rq job if one is caught within 20 s, else any.

        Returns the container and what its rq job was doing: "queued" (taken, not started:
        the fork window), "started" (computing), or "idle" when none was caught.
        """
        containers = self.stack.containers("worker")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for worker in Worker.all(connection=conn):
                rq_id = worker.get_current_job_id()
                match = [c for c in containers if worker.hostname and c.startswith(worker.hostname)]
                if rq_id and match:
                    try:
                        status = Job.fetch(rq_id, connection=conn).get_status()
                    except NoSuchJobError:
                        continue
                    return match[0], getattr(status, "value", str(status))
            time.sleep(0.005)
        return containers[0], "idle"

    def check_fault_job(
        self, store: JobStore, job_id: str, records: list[dict], recorded: PublishedSchedules
    ) -> None:
        assert {rec["job_id"] for rec in records} == {job_id}
        final = store.version(job_id)
        conn = store.conn
        published = [int(f[b"version"]) for _, f in conn.xrange(keys.job_updates(job_id))]
        assert published == list(range(1, final + 1)), published  # none skipped or repeated
        assert not recorded.missed, f"versions deleted before they were read: {recorded.missed}"
        schedules = recorded.schedules
        assert sorted(schedules) == list(range(1, final + 1)), sorted(schedules)
        reported: dict[int, set[int]] = {}  # version -> ranks that reported it
        for rec in records:
            rank = rec["rank"]
            per_step = len(rec["frequencies"]) // FAULT_STEPS
            ran: dict[int, int] = {}
            for step in range(FAULT_STEPS):
                version = version_of_step(rec, step)
                ran[version] = ran.get(version, 0) + 1
                clocks = rec["frequencies"][step * per_step : (step + 1) * per_step]
                assert clocks == schedules[version][rank], f"rank {rank} step {step} v{version}"
            for version, steps in ran.items():
                if steps >= 2:  # ran long enough to report
                    reported.setdefault(version, set()).add(rank)
        # Every result reported is in Redis: as it arrived, or, once the scheduler's snapshot
        # consumed it, counted in that version's summary.
        summaries = store.summaries(job_id)
        for version in range(1, final + 1):
            kept = {int(r) for r in conn.hkeys(keys.job_results(job_id, version))}
            ranks = reported.get(version, set())
            if kept:
                assert kept == ranks, (version, sorted(kept), sorted(ranks))
            elif version in summaries:
                assert summaries[version]["ranks"] == len(ranks), (version, summaries[version])
            else:
                assert not ranks, (version, "reported, but neither kept nor summarized")
        assert conn.xlen(keys.DEADLETTER_STREAM) == 0, "dead letters"
        self.stack.note(
            f"fault job {job_id}: versions 1..{final}, every result stored or summarized, "
            "no dead letters"
        )


def test_readme_docker_block_is_what_the_smoke_test_runs():
    """Runs without Docker: every README command is one the smoke test knows how to check."""
    commands = readme_commands()
    assert commands[0].endswith(">.env") and "PERSEUS_REDIS_PASSWORD" in commands[0]
    assert any("plans/plan.py" in c for c in commands)
    compose_lines = [c for c in commands if c.startswith("docker compose ")]
    assert compose_lines[-1] == "docker compose down -v"
    for command in compose_lines:
        assert step_of(command) is not None, (
            f"README command the smoke test does not check: {command}"
        )


STEPS = {
    "up -d --build": "after_up",
    "ps": "after_ps",
    "exec coordinator perseus status": "after_status",
    """exec worker sh -c 'rq info --url "$PERSEUS_REDIS_URL"'""": "after_rq_info",
    "exec redis redis-cli XINFO GROUPS perseus:stream:results": "after_xinfo",
    "up -d --scale worker=3": "after_scale",
    "down -v": "after_down",
}


def step_of(command: str) -> str | None:
    return STEPS.get(command.removeprefix("docker compose ").strip())


@pytest.mark.docker
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("compose", sorted(COMPOSE_COMMANDS))
def test_compose_stack_end_to_end(compose, tmp_path, monkeypatch):
    reason = docker_unavailable(compose)
    if reason:
        pytest.skip(reason)
    project = tmp_path / "perseus-mq"
    copy_repository(project)
    publish_redis_on_loopback(project / "docker-compose.yml")
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "simgpu"))  # the ranks' GPUs
    transcript = tmp_path / "transcript.txt"
    stack = Stack(compose, project, f"perseus-smoke-{int(time.time())}", transcript)
    # The README's `perseus` on the host: this interpreter's (the venv's).
    stack.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{stack.env.get('PATH', '')}"
    smoke = SmokeRun(stack, out)
    went_down = False
    try:
        for command in readme_commands():
            if not command.startswith("docker compose "):
                stack.shell(command)
                if ".env" in command:
                    smoke.after_env_file()
                if "plans/plan.py" in command:
                    smoke.after_plan_choice()
                continue
            args = shlex.split(command.removeprefix("docker compose "))
            if args[0] == "exec":
                args.insert(1, "-T")  # no terminal here
            output = stack.dc(*args)
            step = step_of(command)
            assert step is not None, command
            getattr(smoke, step)(output)
            smoke.done.append(step)
            went_down = went_down or step == "after_down"
        assert sorted(smoke.done) == sorted(STEPS.values())
        stack.note(f"passed with `{compose}` in {time.monotonic() - stack.started:.0f} s")
    except BaseException:
        for service in ("coordinator", "worker", "redis"):
            stack.dc("logs", "--no-color", "--tail", "150", service, check=False, limit=10**6)
        raise
    finally:
        if not went_down:
            stack.dc("down", "-v", check=False)
        print(transcript.read_text())
