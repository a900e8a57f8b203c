"""``perseus demo``: a whole Perseus run on one machine, without a GPU.

Phases: start a private Redis (or use ``--redis-url``), a coordinator and an rq worker; run a
pipeline of real rank processes (gloo) on simulated GPUs that replay an imbalanced, H100-like
profile, either in the simulation's own loop or through torch's ``Schedule1F1B`` /
``ScheduleGPipe`` with a small real model (``engine="torch-pipelining"``); profile every
stage's instructions with the InstructionProfiler scheduler; measure the P2P blocking power;
plan the time-energy frontier (lowtime's algorithm); choose the no-slowdown plan; train once
at all-max clocks and once with the plan; compare.

Jobs pick their scheduler at registration and plans travel as text in Redis, so the demo works
against any coordinator and workers sharing the Redis (e.g. the docker compose stack).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from coordinator.embedded import EmbeddedRedis
from coordinator.health import agree_settings, last_beats, live_coordinators
from coordinator.resilience import STOP_GRACE_S
from coordinator.service import STOP_WAIT_S, Coordinator
from coordinator.settings import PerseusSettings
from protocol import keys
from protocol.acl import wrong_user
from protocol.cli_options import COMMAND_TIMEOUT_S
from protocol.connection import connect
from protocol.exceptions import ConfigError, PerseusError
from protocol.pipeline_schedules import DEFAULT_SCHEDULE, stage_order
from protocol.server_clock import ServerClock
from protocol.store import JobStore
from schedulers.planning.choose import choose_plan
from schedulers.planning.plan_file import write_plan_file
from schedulers.planning.planner import plan_frontier
from schedulers.planning.plots import plot_frontier, plot_plan_timeline
from schedulers.planning.profile_csv import read_profile_csv
from worker_client.gpu.p2p_power import measure_p2p_power
from worker_client.simulated.gpu import GRAPHICS_CLOCKS, synthetic_instruction_table
from worker_client.simulated.training import launch_simulated_job, rows_of_table

Progress = Callable[[str], None]
ROOT = Path(__file__).resolve().parent.parent
_BLOCK_MS = 200  # the demo's coordinator's read: a stop is seen soon
# Its longest stop, Redis hanging: the read's block and grace, the stop watcher's poll
# (0.5 s), the tidy-up's wait and the cut that ends it; and a second to spare.
_COORDINATOR_STOP_S = _BLOCK_MS / 1000 + 0.5 + 2 * STOP_GRACE_S + STOP_WAIT_S + 1


@dataclass
class DemoConfig:
    """What to simulate.

    Attributes:
        stages: Pipeline stages.
        microbatches: Microbatches per iteration.
        dp: Data parallel degree (ranks = stages * dp).
        redis_url: Use this Redis instead of starting a private one.
        out_dir: Where the profile, the frontier and the plots go.
        clock_stride: Profile every n-th H100 clock (1 = all 110).
        train_steps: Iterations measured per training run (after one warm-up step).
        time_scale: Real seconds slept per simulated second (keeps the ranks in step).
        noise: Relative noise of each simulated instruction.
        blocking_power_w: The simulated GPUs' power while blocked on communication.
        engine: ``"loop"`` (the simulation's own 1F1B/GPipe loop) or ``"torch-pipelining"``
            (torch's schedule under :class:`PerseusPipeline`, a small real model per stage).
        schedule: Pipeline schedule, ``"1f1b"`` or ``"gpipe"``: profiled, planned and trained.
    """

    stages: int = 4
    microbatches: int = 8
    dp: int = 1
    redis_url: str | None = None
    out_dir: Path = Path("perseus-demo")
    clock_stride: int = 4
    train_steps: int = 5
    time_scale: float = 0.01
    noise: float = 0.01
    blocking_power_w: float = 100.0
    engine: str = "loop"
    schedule: str = DEFAULT_SCHEDULE


@dataclass
class RunFigures:
    """Per-iteration figures of one training run (mean over measured steps)."""

    iteration_time: float
    energy: float
    steps: int


@dataclass
class DemoReport:
    """Everything the demo measured and predicted."""

    job_ids: dict[str, str] = field(default_factory=dict)
    profiled_clocks: int = 0
    p2p_power_w: float = 0.0
    plans: int = 0
    chosen_plan: str = ""
    rounding_s: float = 0.0
    predicted_time_s: float = 0.0
    predicted_saving_pct: float = 0.0
    allmax: RunFigures | None = None
    plan: RunFigures | None = None
    frontier_png: Path | None = None
    timeline_png: Path | None = None
    out_dir: Path = Path()

    @property
    def saving_pct(self) -> float:
        """Measured energy saving of the plan against all-max clocks."""
        assert self.allmax and self.plan
        return 100.0 * (1.0 - self.plan.energy / self.allmax.energy)

    @property
    def slowdown_pct(self) -> float:
        """Measured iteration-time change of the plan against all-max clocks."""
        assert self.allmax and self.plan
        return 100.0 * (self.plan.iteration_time / self.allmax.iteration_time - 1.0)


def _own_coordinator(
    conn: redis.Redis, redis_url: str, progress: Progress
) -> tuple[Coordinator, threading.Thread] | None:
    """Start the demo's coordinator thread; None where a running one has other settings.

    Such a coordinator (the compose stack's, say, with a default scheduler) serves the demo's
    jobs as well: each names its own scheduler. Otherwise the demo waits until its own has
    started, so that a coordinator that cannot start fails the demo at once.
    """
    # No default scheduler: every demo job chooses its own.
    settings = PerseusSettings(redis_url=redis_url, scheduler="", log_level="WARNING")
    coordinator = Coordinator(conn, settings)
    try:
        agree_settings(conn, coordinator.consumer, settings.shared(), ServerClock.of(conn).now())
    except redis.exceptions.NoPermissionError as exc:
        raise wrong_user("the demo's coordinator and rq worker", exc) from None
    except ConfigError as exc:
        progress(f"using the coordinator already running on this Redis ({exc})")
        return None
    failed: list[BaseException] = []

    def run() -> None:
        try:
            coordinator.run(block_ms=_BLOCK_MS)
        except BaseException as exc:  # reported below, or by the profiling watcher
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True, name="perseus-demo-coordinator")
    thread.start()
    deadline = time.monotonic() + 30
    while coordinator.consumer not in last_beats(conn) and not failed:
        if time.monotonic() > deadline:
            break  # Slow, not failed: the profiling watcher sees a coordinator that never ran.
        time.sleep(0.05)
    if failed or not thread.is_alive():
        coordinator.stop_event.set()
        raise PerseusError(f"the demo's coordinator did not start: {failed[0] if failed else '?'}")
    return coordinator, thread


@contextmanager
def services(redis_url: str | None, progress: Progress) -> Iterator[str]:
    """A Redis (private unless given), a coordinator thread and an rq worker process.

    On a given Redis where a coordinator with other settings runs already, that one serves
    the demo's jobs (see :func:`_own_coordinator`); the profiling watcher stops the demo if no
    coordinator is left running.
    """
    server = conn = own = worker = None
    # Everything inside the try: an error, Ctrl-C or output cut short (``| head``) stops
    # whatever was started.
    try:
        if redis_url is None:
            server = EmbeddedRedis()
            redis_url = server.url
            progress(f"started a private Redis at {redis_url}")
        # A Redis that hangs fails the demo within seconds, not its commands' 30 s.
        conn = connect(redis_url, ping=True, check_timeout=COMMAND_TIMEOUT_S)
        own = _own_coordinator(conn, redis_url, progress)
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "coordinator.cli",
                "worker",
                "--redis-url",
                redis_url,
                "--log-level",
                "WARNING",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Stopped below, after the ranks, not by Ctrl-C.
        )
        progress("coordinator and rq worker running" if own else "rq worker running")
        yield redis_url
    finally:
        # Every stop asked for before any wait: a signal that interrupts a wait here (a
        # second Ctrl-C, a SIGTERM as training ends) skipped the rest, and the private Redis
        # (a session of its own) was left running.
        if own is not None:
            own[0].stop_event.set()
        if worker is not None:
            worker.terminate()
        try:
            if worker is not None:
                with suppress(subprocess.TimeoutExpired):
                    worker.wait(timeout=10)
                if worker.poll() is None:
                    worker.kill()
            if own is not None:
                # Its stop must be over before the client closes under it (below).
                own[1].join(timeout=_COORDINATOR_STOP_S)
        finally:
            if conn is not None:
                conn.close()
            if server is not None:
                server.stop()


def _figures(records: list[dict[str, Any]], skip: int = 1) -> RunFigures:
    """Iteration time (slowest rank) and energy (all GPUs), averaged over measured steps."""
    steps = min(len(r["iter_time"]) for r in records)
    measured = range(skip, steps)
    if not measured:
        raise PerseusError(f"the training run did only {steps} step(s)")
    times = [max(r["iter_time"][i] for r in records) for i in measured]
    energies = [sum(r["iter_energy"][i] for r in records) for i in measured]
    return RunFigures(sum(times) / len(times), sum(energies) / len(energies), len(times))


def _all_max_plan_text(stages: int, microbatches: int, clock: int, schedule: str) -> str:
    plan = [
        [(n, clock) for n in stage_order(schedule, stages, microbatches, s)] for s in range(stages)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "allmax.py"
        write_plan_file(path, plan, {"plan": "allmax", "pipeline_schedule": schedule})
        return path.read_text()


def run_demo(cfg: DemoConfig, progress: Progress = print) -> DemoReport:
    """Run every phase and return what was measured (see the module docstring)."""
    out = Path(cfg.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report = DemoReport(out_dir=out)
    clocks = sorted(GRAPHICS_CLOCKS, reverse=True)[:: cfg.clock_stride]
    table = synthetic_instruction_table(
        cfg.stages, clocks, noise=cfg.noise, blocking_power_w=cfg.blocking_power_w
    )
    rows = rows_of_table(table)
    common: dict[str, Any] = {
        "time_scale": cfg.time_scale,
        "noise": cfg.noise,
        "blocking_power_w": cfg.blocking_power_w,
        "engine": cfg.engine,
        "schedule": cfg.schedule,
    }
    with (
        tempfile.TemporaryDirectory(prefix="perseus-demo-") as tmp,
        services(cfg.redis_url, progress) as url,
    ):
        os.environ.setdefault("PERSEUS_SIM_GPU_DIR", str(Path(tmp) / "gpus"))
        store = JobStore(connect(url))

        # 1. Profile, inside training, through the coordinator.
        progress(f"[1/4] profiling {len(clocks)} clocks x {cfg.stages} stages x fwd/bwd ...")
        stop_file = Path(tmp) / "profiled"
        args = {
            "microbatches": cfg.microbatches,
            "frequencies": clocks,
            "warmup_iters": 1,
            "schedule": cfg.schedule,
        }
        # A tag of this run's own: a Redis may keep an earlier demo's profile job for a day.
        tag = f"demo-profile-{secrets.token_hex(4)}"
        watcher = ProfileWatcher(store, stop_file, progress, f"+{tag}")
        watcher.start()
        records = launch_simulated_job(
            cfg.stages,
            cfg.microbatches,
            cfg.dp,
            rows,
            url,
            steps=100_000,
            scheduler="InstructionProfiler",
            scheduler_args=args,
            report_every=3,
            instruction_energy=True,
            stop_file=str(stop_file),
            job_metadata=tag,
            **common,
        )
        watcher.stop()
        job_id = records[0]["job_id"]
        report.job_ids["profile"] = job_id
        csv = store.artifacts(job_id).get("profile.csv")
        if csv is None:
            raise PerseusError(f"job {job_id} ended without a profile: {watcher.error}")
        profile_path = out / "profile.csv"
        profile_path.write_bytes(csv)
        report.profiled_clocks = len(clocks)
        progress(f"      profile written to {profile_path} ({len(csv)} bytes)")

        # 2. P2P blocking power.
        progress("[2/4] measuring P2P blocking power ...")
        p2p = measure_p2p_power(
            "simulated",
            seconds=0.5,
            repeats=2,
            devices=(0, 1),
            sim_blocking_power_w=cfg.blocking_power_w,
        )
        report.p2p_power_w = p2p.mean_w
        progress(f"      {p2p.mean_w:.1f} W (+/- {p2p.error_bound_w:.1f} W)")

        # 3. Plan the frontier and choose.
        progress("[3/4] planning the time-energy frontier ...")
        frontier_dir = out / "frontier"
        result = plan_frontier(
            read_profile_csv(profile_path, num_stages=cfg.stages),
            cfg.stages,
            cfg.microbatches,
            out_dir=frontier_dir,
            p2p_power=p2p.mean_w,
            progress=_planner_progress(progress),
            schedule=cfg.schedule,
        )
        chosen = choose_plan(frontier_dir, "no-slowdown")
        report.plans = len(result.pareto)
        report.predicted_time_s = chosen.iteration_time
        report.chosen_plan = chosen.plan
        report.rounding_s = float(result.meta.get("rounding_bound", 0.0))
        report.predicted_saving_pct = chosen.saving_pct
        report.frontier_png = plot_frontier(frontier_dir, out / "frontier.png", chosen.plan)
        report.timeline_png = plot_plan_timeline(
            frontier_dir, chosen.plan, out / f"timeline_{chosen.plan}.png"
        )
        progress(
            f"      {report.plans} Pareto-optimal plans; no-slowdown plan {chosen.plan}: "
            f"predicted {chosen.iteration_time:.4f} s, saving {chosen.saving_pct:.1f}%"
        )

        # 4. Train at all-max clocks, then with the plan.
        runs = {
            "allmax": _all_max_plan_text(cfg.stages, cfg.microbatches, clocks[0], cfg.schedule),
            "plan": Path(chosen.file).read_text(),
        }
        for i, (name, plan_text) in enumerate(runs.items()):
            progress(f"[4/4] training with {'all-max clocks' if i == 0 else 'the plan'} ...")
            records = launch_simulated_job(
                cfg.stages,
                cfg.microbatches,
                cfg.dp,
                rows,
                url,
                steps=cfg.train_steps + 1,
                scheduler="PointSolution3D",
                scheduler_args={"plan_text": plan_text},
                report_every=cfg.train_steps + 1,
                instruction_energy=False,
                job_metadata=f"demo-{name}",
                **common,
            )
            report.job_ids[name] = records[0]["job_id"]
            setattr(report, name, _figures(records))
    return report


def _planner_progress(progress: Progress) -> Callable[[float, str], None]:
    last = [-1]

    def show(fraction: float, message: str) -> None:
        tenth = int(fraction * 10)
        if tenth != last[0]:
            last[0] = tenth
            progress(f"      {fraction:4.0%} {message}")

    return show


class ProfileWatcher(threading.Thread):
    """Shows profiling progress and drops the stop file once the profile is in Redis."""

    def __init__(self, store: JobStore, stop_file: Path, progress: Progress, suffix: str) -> None:
        super().__init__(daemon=True, name="perseus-demo-watch")
        self.store, self.stop_file, self.progress, self.suffix = store, stop_file, progress, suffix
        self.error = ""
        self._stop_event = threading.Event()

    def run(self) -> None:
        """Watch until the profile is in Redis, the job failed, or no coordinator is left."""
        try:
            self._watch()
        except redis.RedisError as exc:  # Redis went away: the demo is shutting down.
            self.error = f"lost Redis: {exc}"

    def _watch(self) -> None:
        shown = 0
        while not self._stop_event.wait(0.2):
            jobs = [j for j, _ in self.store.list_jobs() if j.endswith(self.suffix)]
            if not jobs:
                continue
            job_id = jobs[0]
            version = self.store.version(job_id)
            if version >= shown + 5:  # A line every five sweep steps is enough to show life.
                shown = version
                self.progress(f"      sweep step {version} (schedule version {version})")
            if not live_coordinators(self.store.conn, self.store.clock.now()):
                self.error = "no coordinator is running on this Redis any more"
                self.stop_file.touch()
                return
            record_error = self.store.get_job(job_id).error
            if record_error or self.store.conn.hexists(keys.job_artifacts(job_id), "profile.csv"):
                self.error = record_error
                self.stop_file.touch()
                return

    def stop(self) -> None:
        """Stop watching (the demo goes on without it)."""
        self._stop_event.set()
        self.join(timeout=2)


def format_report(report: DemoReport) -> str:
    """The table ``perseus demo`` prints."""
    assert report.allmax and report.plan
    lines = [
        "",
        f"{'':<18}{'iteration time':>16}{'energy / iteration':>22}",
        f"{'all-max clocks':<18}{report.allmax.iteration_time:>14.4f} s"
        f"{report.allmax.energy:>20.1f} J",
        f"{'Perseus plan':<18}{report.plan.iteration_time:>14.4f} s{report.plan.energy:>20.1f} J",
        "",
        f"energy saved: {report.saving_pct:.1f}% (planner predicted "
        f"{report.predicted_saving_pct:.1f}%)",
        f"slowdown:     {report.slowdown_pct:+.2f}% (planner predicted "
        f"{report.predicted_time_s:.4f} s; rounding bound {report.rounding_s * 1000:.1f} ms)",
        f"plan {report.chosen_plan}, one of {report.plans} Pareto-optimal plans; "
        f"P2P blocking power {report.p2p_power_w:.1f} W",
        f"frontier: {report.frontier_png}",
        f"timeline: {report.timeline_png}",
        f"profile:  {report.out_dir / 'profile.csv'}",
    ]
    return "\n".join(lines)
