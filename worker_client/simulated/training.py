"""Simulated pipeline-parallel training: one process per rank, a simulated GPU each.

Each rank runs synchronous 1F1B (or GPipe) iterations under :class:`PerseusOptimizer`, exactly
as a real training script would, except that an instruction is a :class:`SimulatedGPU` replaying an
:class:`InstructionTable` at the clock the frequency controller locked. Pipeline dependencies
are real: a forward waits for the previous stage's activation and a backward for the next
stage's gradient, carried by gloo point-to-point messages of a tiny tensor, so a slow stage
holds the others up as in real training. Sends are non-blocking (as in Megatron's batched
``isend``/``irecv``): two neighbours sending to each other at once must not deadlock. With
``engine="torch-pipelining"`` torch's own schedule runs the iterations instead
(:mod:`worker_client.simulated.pipelining`).

Time: instructions sleep ``time * time_scale`` so that real execution order follows the
pipeline, but every reported time and energy is in the table's (profile) units.

* ``timing="virtual"`` (default): the hook's clock is a simulated clock. It advances by each
  instruction's replayed time, and each message carries the sender's clock so that a receive
  moves the receiver's clock to ``max(own, sender's)``; the iteration ends at the largest clock
  of any rank. This evaluates the pipeline DAG exactly (no scheduling jitter or per-call overhead
  in the figures), which is what a profiler test needs to check percent-level accuracy on a
  busy machine.
* ``timing="wall"``: the hook's clock is ``time.perf_counter() / time_scale``, i.e. measured
  wall time scaled back to profile units; overheads (NVML-file I/O, the controller's flush,
  process scheduling) then show up in the figures, scaled by ``1 / time_scale`` as well.

Energy: the simulated GPU's counter grows by each instruction's replayed energy; whenever a
GPU is not computing (waiting on a neighbour, or for the slowest rank at the end of the
iteration) it draws the table's blocking power, accounted once per iteration as
``gpu.idle(iteration time - compute time)``. Iteration energy is therefore compute plus
blocking energy, as in Perseus's model (``energy + p2p_power * blocked time``).

:func:`run_simulated_rank` is the body of one rank (top level, so it pickles for ``spawn``);
:func:`launch_simulated_job` spawns every rank of a job and collects their records.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from protocol.pipeline_schedules import DEFAULT_SCHEDULE, check_schedule, stage_order
from worker_client.gpu.frequency import make_controller
from worker_client.gpu.nvml import SIMULATED_NVML
from worker_client.simulated.gpu import SimulatedGPU, device_count
from worker_client.simulated.instruction_table import InstructionTable
from worker_client.simulated.step_account import SimClock, StepAccount, Timing

Row = tuple[int, str, int, float, float]
#: Instruction table as rows ``(stage, instruction, frequency, time_s, energy_j)`` (or CSV
#: mappings) or the path of a profile CSV: plain data, so it pickles for ``spawn``.
TableSpec = str | Sequence[Sequence[Any] | Mapping[str, Any]]
#: How a rank runs its instructions: this module's own loop, or torch's pipeline schedules.
Engine = Literal["loop", "torch-pipelining"]
ENGINES: tuple[str, ...] = ("loop", "torch-pipelining")

_TAGS = {"forward": 1, "backward": 2}


@dataclass(frozen=True)
class SimulatedRankConfig:
    """Everything one simulated rank needs (picklable).

    Attributes:
        rank: Global rank; ``pp_rank = rank % num_stages``, ``dp_rank = rank // num_stages``.
        world_size: Number of ranks (``num_stages * dp``).
        num_stages: Pipeline stages.
        microbatches: Microbatches per iteration.
        init_method: ``torch.distributed`` init method, e.g. ``tcp://127.0.0.1:29500``.
        redis_url: The coordinator's Redis.
        table: Instruction table rows or a profile CSV path (see :data:`TableSpec`).
        steps: Most iterations to run.
        time_scale: Real sleep per instruction over its profile time (0: do not sleep).
        timing: ``"virtual"`` or ``"wall"`` (module docstring).
        report_every: The hook's steps per profiling window.
        instruction_energy: Let the hook report per-instruction energies.
        noise: Relative noise of each replayed instruction (see :class:`InstructionTable`).
        seed: Noise seed (each rank adds its rank).
        blocking_power_w: GPU power while not computing, W.
        device_id: Simulated GPU index (default: the rank).
        job_metadata: Tag appended to the job id.
        stop_file: Stop early once this file (or a file matching this glob pattern) exists
            (checked by every rank at each step end;
            all ranks stop after the same step).
        steps_after_stop: Iterations still run after ``stop_file`` appeared.
        schedule_timeout: Seconds the hook waits for the first schedule.
        sim_gpu_dir: ``PERSEUS_SIM_GPU_DIR`` to use (default: inherited).
        sim_gpu_count: ``PERSEUS_SIM_GPU_COUNT`` to use (default: inherited).
        scheduler: Built-in scheduler the job asks for (default: the coordinator's).
        scheduler_args: Its arguments.
        schedule: Pipeline schedule, ``"1f1b"`` or ``"gpipe"``.
        engine: ``"loop"`` (this module's loop) or ``"torch-pipelining"`` (a small real
            model under torch's ``Schedule1F1B``/``ScheduleGPipe`` and
            :class:`~worker_client.integrations.torch_pipelining.PerseusPipeline`).

    """

    rank: int
    world_size: int
    num_stages: int
    microbatches: int
    init_method: str
    redis_url: str
    table: TableSpec
    steps: int
    time_scale: float = 0.05
    timing: Timing = "virtual"
    report_every: int = 3
    instruction_energy: bool = True
    noise: float = 0.0
    seed: int = 0
    blocking_power_w: float = 100.0
    device_id: int | None = None
    job_metadata: str | None = None
    stop_file: str | None = None
    steps_after_stop: int = 0
    schedule_timeout: float = 60.0
    sim_gpu_dir: str | None = None
    sim_gpu_count: int | None = None
    scheduler: str | None = None
    scheduler_args: dict[str, Any] | None = None
    schedule: str = DEFAULT_SCHEDULE
    engine: Engine = "loop"

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.world_size % self.num_stages:
            raise ValueError(
                f"world_size {self.world_size} is not a multiple of num_stages {self.num_stages}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world size {self.world_size}")
        if self.time_scale < 0 or (self.timing == "wall" and self.time_scale <= 0):
            raise ValueError(
                f"time_scale must be >= 0 (> 0 for wall timing), got {self.time_scale}"
            )
        if self.timing not in ("virtual", "wall"):
            raise ValueError(f"timing must be 'virtual' or 'wall', got {self.timing!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        check_schedule(self.schedule)

    @property
    def pp_rank(self) -> int:
        """Pipeline stage of this rank."""
        return self.rank % self.num_stages

    @property
    def dp_rank(self) -> int:
        """Data parallel rank."""
        return self.rank // self.num_stages


def rows_of_table(table: InstructionTable) -> list[Row]:
    """Rows of an InstructionTable, for passing it to spawned ranks."""
    return [(s, i, f, t, e) for (s, i, f), (t, e) in sorted(table.items())]


def load_table(cfg: SimulatedRankConfig) -> InstructionTable:
    """Build the rank's replay table (per-rank noise seed)."""
    kwargs: dict[str, Any] = {
        "noise": cfg.noise,
        "seed": cfg.seed + cfg.rank,
        "blocking_power_w": cfg.blocking_power_w,
    }
    if isinstance(cfg.table, str):
        return InstructionTable.from_csv(cfg.table, **kwargs)
    return InstructionTable(cfg.table, **kwargs)


def run_simulated_rank(cfg: SimulatedRankConfig) -> dict[str, Any]:
    """Run one simulated rank to the end; return its record.

    Initializes gloo, registers through :class:`PerseusOptimizer` (simulated NVML, simulated
    frequency controller, energy from the GPU's counter), runs up to ``cfg.steps`` 1F1B
    iterations and tears everything down. A rank that cannot make its simulated GPU, table,
    clock or controller fails every rank at once (the others' hooks raise "no job registered;
    rank N: ...") instead of leaving them waiting in their hook's first collective.

    Returns:
        ``rank``, ``pp_rank``, ``dp_rank``, ``job_id``, per step ``iter_time``,
        ``iter_energy``, ``compute_time``, ``compute_energy``, ``idle_energy`` and
        ``version`` (the schedule version the step ran), ``schedules`` (version as a string ->
        the rank's ``(instruction, MHz)`` pairs), ``swaps``, ``final_version``,
        ``reports_sent`` and ``reports_unsent`` (once the hook closed; results the reporter
        gave up on, each also logged).

    """
    if cfg.sim_gpu_dir is not None:
        os.environ["PERSEUS_SIM_GPU_DIR"] = cfg.sim_gpu_dir
    if cfg.sim_gpu_count is not None:
        os.environ["PERSEUS_SIM_GPU_COUNT"] = str(cfg.sim_gpu_count)
    # The hook maps device_id through CUDA_VISIBLE_DEVICES; a simulated rank's device is the
    # simulated GPU it drives, whatever GPUs the host lends this process (it runs on the CPU).
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    # torch (the hook imports it too) loads only in the rank processes, not in the launcher.
    import torch.distributed as dist

    from worker_client.hook.joining import refuse_to_join
    from worker_client.hook.optimizer import PerseusOptimizer

    device = cfg.rank if cfg.device_id is None else cfg.device_id
    dist.init_process_group(
        "gloo", init_method=cfg.init_method, rank=cfg.rank, world_size=cfg.world_size
    )
    try:
        try:
            gpu = SimulatedGPU(device, table=load_table(cfg))
            clock = SimClock(cfg.timing, cfg.time_scale)
            controller = make_controller("simulated", device)
        except Exception as exc:  # the other ranks' hooks wait for this one's: tell them why
            refuse_to_join(cfg.rank, exc)
        try:
            # energy_source defaults to CounterEnergySource on the hook's (simulated) NVML.
            hook = PerseusOptimizer(
                rank=cfg.rank,
                dp_rank=cfg.dp_rank,
                pp_rank=cfg.pp_rank,
                tp_rank=0,
                device_id=device,
                dp_degree=cfg.world_size // cfg.num_stages,
                pp_degree=cfg.num_stages,
                tp_degree=1,
                world_size=cfg.world_size,
                redis_url=cfg.redis_url,
                job_metadata=cfg.job_metadata,
                nvml_module=SIMULATED_NVML,
                controller=controller,
                report_every=cfg.report_every,
                schedule_timeout=cfg.schedule_timeout,
                instruction_energy=cfg.instruction_energy,
                clock=clock.now,
                scheduler=cfg.scheduler,
                scheduler_args=cfg.scheduler_args,
            )
        except BaseException:
            controller.stop()
            raise
        try:
            if cfg.engine == "torch-pipelining":
                # torch's pipelining: imported in the rank processes only.
                from worker_client.simulated.pipelining import train_torch_pipelining

                steps = train_torch_pipelining(cfg, hook, gpu, controller, clock)
            else:
                steps = _train(cfg, hook, gpu, controller, clock)
        finally:
            hook.close()  # Also stops the controller, which resets the clocks.
        # Counted after close, which sends what the reporter still held (on a loaded machine,
        # a short run's only result may still be queued at its last step end).
        steps["reports_sent"] = hook.reporter.sent
        steps["reports_unsent"] = hook.reporter.unsent
        record = {"rank": cfg.rank, "pp_rank": cfg.pp_rank, "dp_rank": cfg.dp_rank}
        return {**record, "job_id": hook.job_id, **steps}
    finally:
        dist.destroy_process_group()


def _train(
    cfg: SimulatedRankConfig, hook: Any, gpu: Any, controller: Any, clock: SimClock
) -> dict[str, Any]:
    """The training loop of one rank (see the module docstring)."""
    import torch  # torch: only in the rank processes (see run_simulated_rank)
    import torch.distributed as dist

    stage, rank = cfg.pp_rank, cfg.rank
    order = stage_order(cfg.schedule, cfg.num_stages, cfg.microbatches, stage)
    prev_rank = rank - 1 if stage > 0 else None
    next_rank = rank + 1 if stage < cfg.num_stages - 1 else None
    upstream = {"forward": prev_rank, "backward": next_rank}  # Who sends us the input.
    downstream = {"forward": next_rank, "backward": prev_rank}  # Who needs our output.
    account = StepAccount(gpu, clock, cfg.stop_file, cfg.steps_after_stop)
    for _ in range(cfg.steps):
        account.begin(hook)
        hook.on_step_begin()
        sends: list[tuple[Any, Any]] = []
        for name in order:
            source = upstream[name]
            if source is not None:
                inbox = torch.zeros(1, dtype=torch.float64)
                dist.recv(inbox, src=source, tag=_TAGS[name])
                clock.catch_up(float(inbox[0]))
            hook.on_instruction_begin(name)
            controller.flush()  # The clock must be applied before the instruction runs.
            t, e = gpu.run(stage, name, cfg.time_scale)
            clock.advance(t)
            hook.on_instruction_end(name)
            account.add(t, e)
            target = downstream[name]
            if target is not None:
                outbox = torch.tensor([clock.now()], dtype=torch.float64)
                sends.append((dist.isend(outbox, dst=target, tag=_TAGS[name]), outbox))
        for work, _outbox in sends:
            work.wait()
        account.sync()
        hook.on_step_end()
        if account.end():
            break
    return account.record(hook)


def _rank_main(cfg: SimulatedRankConfig, out_path: str) -> None:
    """Spawn target: run the rank, write its record (or traceback) as JSON, exit at once."""
    # Ctrl-C reaches the whole process group; the launcher decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        record = run_simulated_rank(cfg)
    except BaseException:
        record = {"rank": cfg.rank, "error": traceback.format_exc()}
    # The launcher may already be gone (Ctrl-C) and its folder with it.
    with contextlib.suppress(OSError):
        Path(out_path).write_text(json.dumps(record))
    # Skip interpreter teardown: torch/gloo threads can hang it, and the record is written.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_simulated_job(
    num_stages: int,
    microbatches: int,
    dp: int,
    table_rows: InstructionTable | TableSpec | Path,
    redis_url: str,
    steps: int,
    *,
    timeout: float = 600.0,
    out_dir: str | Path | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """Spawn every rank of a simulated job, wait for them and return their records.

    Args:
        num_stages: Pipeline stages.
        microbatches: Microbatches per iteration.
        dp: Data parallel degree (``world_size = num_stages * dp``).
        table_rows: The instruction table: an InstructionTable (its blocking power is used
            unless ``blocking_power_w`` is given), rows, or a profile CSV path.
        redis_url: The coordinator's Redis.
        steps: Most iterations per rank.
        timeout: Seconds to wait for the ranks; then they are terminated and this raises.
        out_dir: Where ranks write their records (default: a temporary folder).
        **options: Any other :class:`SimulatedRankConfig` field (``time_scale``, ``timing``,
            ``report_every``, ``noise``, ``stop_file``, ...).

    Returns:
        One record per rank (see :func:`run_simulated_rank`), sorted by rank.

    Raises:
        RuntimeError: A rank failed (its traceback is in the message) or timed out.

    """
    if isinstance(table_rows, InstructionTable):
        options.setdefault("blocking_power_w", table_rows.blocking_power_w)
        spec: TableSpec = rows_of_table(table_rows)
    elif isinstance(table_rows, (str, Path)):
        spec = str(table_rows)
    else:
        spec = list(table_rows)
    world = num_stages * dp
    if world > device_count():
        options.setdefault("sim_gpu_count", world)
    base = SimulatedRankConfig(
        rank=0,
        world_size=world,
        num_stages=num_stages,
        microbatches=microbatches,
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        redis_url=redis_url,
        table=spec,
        steps=steps,
        **options,
    )
    with tempfile.TemporaryDirectory(prefix="perseus-sim-") as tmp:
        folder = Path(out_dir) if out_dir is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        ctx = mp.get_context("spawn")
        procs = []
        with _sigint_ignored():
            for rank in range(world):
                path = folder / f"rank{rank}.json"
                path.unlink(missing_ok=True)
                proc = ctx.Process(
                    target=_rank_main,
                    args=(replace(base, rank=rank), str(path)),
                    name=f"perseus-sim-rank{rank}",
                )
                proc.start()
                procs.append((proc, path))
        deadline = time.monotonic() + timeout
        try:
            for proc, _ in procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        finally:  # Also on Ctrl-C: no rank outlives the launcher.
            stuck = [p.name for p, _ in procs if p.is_alive()]
            for proc, _ in procs:
                if proc.is_alive():
                    proc.terminate()
                    proc.join(5)
        records = []
        for proc, path in procs:
            if not path.exists():
                raise RuntimeError(
                    f"{proc.name} left no record (exit code {proc.exitcode}"
                    + (f"; still running after {timeout:.0f} s: {stuck}" if stuck else "")
                    + ")"
                )
            records.append(json.loads(path.read_text()))
    errors = [f"rank {r['rank']}:\n{r['error']}" for r in records if "error" in r]
    if errors:
        raise RuntimeError("simulated ranks failed:\n" + "\n".join(errors))
    return sorted(records, key=lambda r: r["rank"])


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT while ranks start, so that they inherit ignoring it.

    Ctrl-C reaches the whole process group. The launcher stops the ranks itself (above); a rank
    interrupted in the middle of its imports would only print a traceback.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # Only the main thread may change signal handlers.
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
