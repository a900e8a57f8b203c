"""PerseusOptimizer: the training hook that runs each instruction at its planned frequency.

Rank 0 registers the job, the job id is broadcast with ``torch.distributed``, and every rank
registers with its GPU's available frequencies (:mod:`worker_client.hook.joining`). Each rank
then follows its frequency schedule instruction by instruction, checks the instruction order
against it, reports profiling results every ``report_every`` steps, and swaps in a newer
schedule version only between steps. Clock changes go to a frequency controller in a side
process; Redis I/O happens in background threads, so neither blocks a step.

Energy: the training thread only takes *marks* of an :class:`EnergySource` (at step
boundaries, and at instruction boundaries with ``instruction_energy=True``); a result-building
thread turns them into Joules when a report is due, so a source that must wait for samples
(:class:`~worker_client.hook.energy_source.MonitorEnergySource`) never stalls a step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from multiprocessing.util import Finalize
from typing import Any, Literal

import torch.distributed as dist

from protocol.exceptions import JobFailedError, ScheduleError
from protocol.models import FrequencySchedule
from worker_client.callback import Callback
from worker_client.hook.clock_requests import (
    ClockRequester,
    FrequencySetter,
    Marker,
    cuda_sync,
)
from worker_client.hook.energy_source import EnergySource, Mark
from worker_client.hook.joining import RankGPU, finish_rank
from worker_client.hook.options import check_identity, check_options, zeus_keywords
from worker_client.hook.result_builder import ResultBuilder, Window
from worker_client.hook.session import CoordinatorClient
from worker_client.hook.startup import start_rank
from worker_client.hook.step_order import StepOrder
from worker_client.hook.watchers import ResultReporter, ScheduleWatcher

logger = logging.getLogger(__name__)


class PerseusOptimizer(Callback):
    """Perseus frequency-plan hook for one rank.

    Assumes ``torch.distributed`` is initialized (any backend); on GPUs, call
    ``torch.cuda.set_device(device_id)`` first.

    Args:
        rank: Global rank.
        dp_rank: Data parallel rank.
        pp_rank: Pipeline parallel rank (stage).
        tp_rank: Tensor parallel rank.
        device_id: CUDA index of the GPU this rank drives, as Zeus and ``torch.cuda`` take it;
            clocks and energy go to its NVML index, read from ``CUDA_VISIBLE_DEVICES`` (see
            :meth:`~worker_client.gpu.nvml.NVML.cuda_to_nvml`).
        dp_degree: Data parallel degree.
        pp_degree: Pipeline parallel degree.
        tp_degree: Tensor parallel degree.
        world_size: Number of ranks.
        redis_url: The Redis the coordinator uses (instead of Zeus's server URL).
        job_metadata: Optional tag appended to the job id.
        nvml_module: NVML module to read clocks and energy from: ``"pynvml"`` (real GPU)
            or ``"worker_client.simulated.gpu"``.
        controller: Frequency controller, or one of ``"nvml"`` (through ``nvml_module``),
            ``"dry-run"``, ``"simulated"`` (see
            :func:`worker_client.gpu.frequency.make_controller`).
        report_every: Steps per profiling window; one result is reported per schedule version.
        schedule_timeout: Seconds to wait for the first schedule; each registration reply
            waits as long too (10 s at least, 60 s at most).
        energy_source: Where energy comes from (see :mod:`worker_client.hook.energy_source`).
            Default: the GPU's energy counter (0 J if it has none), read on the training
            thread where a read is cheap and by a sampler thread where it is not (see
            :func:`~worker_client.hook.energy_source.default_energy_source`).
        instruction_energy: Also mark instruction boundaries and report
            ``energy_breakdown`` (same shape as ``time_breakdown``). ``None`` (default): when
            the job's scheduler needs it (``InstructionProfiler``), as the coordinator's reply
            to this rank's registration says; ``False`` with such a scheduler is an error.
            With the counter source on a real GPU each mark costs a few ms, so prefer a
            ``MonitorEnergySource`` there.
        sync_fn: Waits for the GPU to finish queued work before timing an instruction.
        clock: Seconds for iteration and instruction times (default ``time.perf_counter``);
            simulations pass their simulated clock.
        scheduler: A built-in scheduler for this job instead of the coordinator's default
            (used by rank 0 when it registers the job), e.g. ``"InstructionProfiler"``.
        scheduler_args: Arguments of ``scheduler`` (JSON-compatible).
        outage_timeout: Seconds Redis may stay unreachable before a step end raises
            :class:`~protocol.exceptions.CoordinatorUnavailableError`. ``None`` (default):
            training never stops for an outage; it keeps the current schedule, results wait
            and are sent once Redis is back.
        heartbeat_interval: Seconds between this rank's heartbeats, which keep the job from
            being deleted as idle while it trains on a schedule that no longer changes
            (finite, at least 0.1 s).
        raise_on_job_error: If the job's scheduler fails, raise
            :class:`~protocol.exceptions.JobFailedError` at the next step end. Default: log the
            error loudly once (every rank) and train on at the last schedule; the error is
            also in :attr:`job_error` until the scheduler computes again (logged too).
        clock_sync: How a clock change waits for the work queued before it. ``"wait"``
            (default): ``sync_fn`` on the training thread, then the request. ``"events"``:
            outside profiling windows the training thread only records a marker (a CUDA
            event on the current stream) and a side thread requests the clock once the GPU
            reaches it, so a step that is not measured never waits for the GPU. Profiling
            windows synchronize either way (their times are wall-clock times). Meant for
            GPU-bound steps: where launching keeps the CPU busy, the side thread competes
            with it and can slow a step down.
        marker_fn: Records and returns a marker of the work queued so far, for
            ``clock_sync="events"`` (default: a blocking ``torch.cuda.Event``; CUDA only).

    Raises:
        ConfigError: An argument of the wrong type or range, named before anything starts.
    """

    @zeus_keywords
    def __init__(
        self,
        rank: int,
        dp_rank: int,
        pp_rank: int,
        tp_rank: int,
        device_id: int,
        dp_degree: int,
        pp_degree: int,
        tp_degree: int,
        world_size: int,
        redis_url: str,
        job_metadata: str | None = None,
        *,
        nvml_module: str = "pynvml",
        controller: FrequencySetter | str = "nvml",
        report_every: int = 10,
        schedule_timeout: float = 120.0,
        energy_source: EnergySource | None = None,
        instruction_energy: bool | None = None,
        sync_fn: Callable[[], None] | None = None,
        clock: Callable[[], float] | None = None,
        scheduler: str | None = None,
        scheduler_args: dict[str, Any] | None = None,
        outage_timeout: float | None = None,
        heartbeat_interval: float = 60.0,
        raise_on_job_error: bool = False,
        clock_sync: Literal["wait", "events"] = "wait",
        marker_fn: Callable[[], Marker] | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Create PerseusOptimizer after torch.distributed.init_process_group")
        self.rank, self.dp_rank, self.pp_rank, self.tp_rank = rank, dp_rank, pp_rank, tp_rank
        # The job's layout as this rank registers it (PerseusPipeline checks it against torch's).
        self.dp_degree, self.pp_degree, self.tp_degree = dp_degree, pp_degree, tp_degree
        self.world_size = world_size
        self.device_id = device_id
        self.report_every = report_every
        self._sync = sync_fn or cuda_sync(device_id)
        self._clock = clock or time.perf_counter
        self.raise_on_job_error = raise_on_job_error

        # What fails on one rank only (its arguments, its Redis URL, its GPU) fails every rank
        # in the join's first collective, where the others would wait for it: no job is
        # registered. This rank's GPU comes first for the same reason.
        failure: Exception | None = None
        client: CoordinatorClient | None = None
        gpu: RankGPU | None = None
        try:
            check_identity(
                {
                    "rank": rank, "dp_rank": dp_rank, "pp_rank": pp_rank, "tp_rank": tp_rank,
                    "device_id": device_id, "dp_degree": dp_degree, "pp_degree": pp_degree,
                    "tp_degree": tp_degree, "world_size": world_size,
                },
                redis_url, job_metadata, nvml_module, controller,
                {
                    "instruction_energy": instruction_energy,
                    "raise_on_job_error": raise_on_job_error,
                },
                scheduler, scheduler_args,
            )  # fmt: skip
            marker_fn = check_options(
                report_every, schedule_timeout, outage_timeout, heartbeat_interval, clock_sync,
                marker_fn,
            )  # fmt: skip
            # A short schedule_timeout is meant to fail fast: registration's replies too (but
            # 10 s at least: a loaded coordinator may take seconds, and a reply too late is lost).
            client = CoordinatorClient(
                redis_url, reply_timeout=min(60.0, max(10.0, schedule_timeout))
            )
            gpu = RankGPU.open(nvml_module, device_id, controller)
        except Exception as exc:
            failure = exc
        started = start_rank(
            rank,
            (dp_rank, pp_rank, tp_rank),
            {
                "dp_degree": dp_degree, "pp_degree": pp_degree, "tp_degree": tp_degree,
                "world_size": world_size, "job_metadata": job_metadata,
                "scheduler": scheduler, "scheduler_args": scheduler_args,
            },
            client, gpu, failure, instruction_energy, energy_source, schedule_timeout,
        )  # fmt: skip
        self.client, self.job_id = started.client, started.job_id
        gpu = started.gpu
        self.nvml, self.gpu_index = gpu.nvml, gpu.index  # NVML's index: clocks, energy
        self.instruction_energy = started.instruction_energy
        self.schedule = started.schedule
        # Joined: from here on only the threads below talk to Redis, on connections of their
        # own (two per rank, not three).
        self.client.release_idle()
        self._owned_source = started.owns_source
        self.energy_source: EnergySource = started.energy_source
        self.controller: FrequencySetter = gpu.controller
        self._marker_fn = marker_fn
        self._clocks: ClockRequester | None = None
        if clock_sync == "events":
            self._clocks = ClockRequester(self.controller)
            self._clocks.start()
        self.order = StepOrder(rank, self.schedule)
        self.watcher = ScheduleWatcher(
            self.client,
            self.job_id,
            rank,
            self.schedule.version,
            outage_timeout=outage_timeout,
            heartbeat_interval=heartbeat_interval,
        )
        self.watcher.start()
        self.reporter = ResultReporter(self.client, self.job_id, outage_timeout)
        self.reporter.start()
        # Turns marks into energies and results, in report order, off the training thread.
        self._results = ResultBuilder(self.energy_source, rank, self.reporter)
        self._measuring = False
        self._reset_window()
        self.steps = 0
        self.swaps: list[tuple[int, int]] = []  # (step, version) of every swap, for inspection
        self._closed = False
        self._frequency: int | None = None  # the clock last requested
        self.syncs = 0  # GPU synchronizations so far (each costs a pipeline bubble)
        # A script that ends without close() (Zeus's hook has none) still sends its queued
        # results and marks its rank finished: the threads are daemons, so nothing else would.
        # multiprocessing's exit finalizers run at interpreter exit and also in its children,
        # forked ones too (which skip atexit); never in a fork of this process (see below).
        self._pid = os.getpid()
        self._at_exit = Finalize(None, self._close_at_exit, exitpriority=10)

    @property
    def job_error(self) -> str:
        """The job's scheduler failure while it lasts: empty again once its scheduler computes."""
        return self.watcher.job_error

    # --- measurement -----------------------------------------------------------------------
    def _reset_window(self) -> None:
        self._iter_time: list[float] = []
        self._iter_marks: list[Mark] = []
        self._breakdown: dict[str, list[list[float]]] = {}
        self._mark_breakdown: dict[str, list[list[Mark]]] = {}
        self._reported = False

    # --- hooks -----------------------------------------------------------------------------
    def on_step_begin(self) -> None:
        """Start timing a step."""
        if self._closed:
            raise ScheduleError(
                f"rank {self.rank}: on_step_begin() after close(): this hook's rank is finished "
                "(build a new PerseusOptimizer to go on)"
            )
        self.order.begin_step()
        # After this version's report nothing is measured until the next version.
        self._measuring = not self._reported
        self._step_breakdown: dict[str, list[float]] = {}
        self._step_marks: dict[str, list[Mark]] = {}
        if self._measuring:
            self._sync()  # The previous step's queued work is not this step's.
            self.syncs += 1
            if self._clocks is not None:
                self._clocks.flush()  # The last step's clocks are requested before timing.
            self._step_mark = self.energy_source.mark()
        self._step_time = self._clock()

    def on_instruction_begin(self, name: str) -> None:
        """Check ``name`` against the schedule and set its frequency.

        Waits for the GPU only where it matters: before timing an instruction, and before a
        clock change (queued work must finish at the clock it was planned for); with
        ``clock_sync="events"``, a clock change outside profiling windows hands a marker to
        the side thread instead.
        """
        frequency = self.order.begin(name)
        changed = frequency != self._frequency
        self._frequency = frequency
        if self._clocks is None:
            if self._measuring or changed:
                self._sync()
                self.syncs += 1
            self.controller.set_frequency(frequency)
        elif self._measuring:
            self._sync()
            self.syncs += 1
            if changed:  # requested before the instruction is timed
                self._clocks.request(frequency, None, wait=True)
        elif changed:
            assert self._marker_fn is not None
            self._clocks.request(frequency, self._marker_fn())
        if self._measuring and self.instruction_energy:
            self._inst_mark = self.energy_source.mark()
        self._inst_start = self._clock()

    def on_instruction_end(self, name: str) -> None:
        """Record the instruction's duration (and energy mark)."""
        self.order.end(name)
        if not self._measuring:
            return
        self._sync()
        self.syncs += 1
        elapsed = self._clock() - self._inst_start
        self._step_breakdown.setdefault(name, []).append(elapsed)
        if self.instruction_energy:
            end = self.energy_source.mark()
            self._step_marks.setdefault(name, []).append((self._inst_mark, end))

    def on_step_end(self) -> None:
        """Check the schedule was used up, report if due, and swap in a newer version."""
        if self._clocks is not None and self._clocks.error is not None:
            raise self._clocks.error  # before a step run at wrong clocks could be reported
        in_step = self.order.end_step()
        # The next step starts at the first instruction, whatever is raised below (a swap
        # restarts it at the new schedule's).
        self.order.restart(self.schedule)
        self.steps += 1
        if in_step and self._measuring:
            self._sync()
            self.syncs += 1
            self._iter_time.append(self._clock() - self._step_time)
            self._iter_marks.append((self._step_mark, self.energy_source.mark()))
            for name, times in self._step_breakdown.items():
                self._breakdown.setdefault(name, []).append(times)
            for name, marks in self._step_marks.items():
                self._mark_breakdown.setdefault(name, []).append(marks)
        self._measuring = False
        if not self._reported and len(self._iter_time) >= self.report_every:
            # The window's lists are not touched again: a swap replaces them.
            window = Window(
                self._iter_time, self._iter_marks, self._breakdown, self._mark_breakdown
            )
            self._results.submit(self.report_every, self.schedule.version, window)
            self._reported = True
        build_error, remeasure = self._results.take()
        if remeasure and self._reported:
            self._reset_window()  # before raising: a caller who goes on measures it again
        if build_error is not None:
            raise build_error
        for worker in (self.watcher, self.reporter):
            if worker.error is not None:
                raise worker.error
        if self.raise_on_job_error and self.watcher.job_error:
            raise JobFailedError(f"job {self.job_id}: scheduler failed: {self.watcher.job_error}")
        self._resend_if_republished()
        newer = self.watcher.take()
        if newer is not None:
            self._swap(newer)

    def abandon_step(self) -> None:
        """Forget the step in progress, e.g. one that raised: nothing of it is measured.

        The next :meth:`on_step_begin` starts again at the schedule's first instruction.
        """
        self._measuring = False
        self.order.abandon()

    def _resend_if_republished(self) -> None:
        """Send this version's result again if Redis lost the version and got it back."""
        version = self.watcher.take_republished()
        last = self._results.last_result
        if version is None or last is None or last.schedule_version != version:
            return  # Not reported yet: the regular report goes to the version now in Redis.
        logger.warning(
            "rank %d: schedule version %d was published again (Redis lost it); sending its "
            "result again",
            self.rank,
            version,
        )
        self.reporter.submit(last)

    def _swap(self, schedule: FrequencySchedule) -> None:
        self.schedule = schedule
        self.order.restart(schedule)
        self.swaps.append((self.steps, schedule.version))
        self._reset_window()
        logger.debug("rank %d: now running schedule version %d", self.rank, schedule.version)

    def on_train_end(self) -> None:
        """Flush results, mark this rank finished, stop background threads and the controller."""
        self.close()

    def close(self) -> None:
        """Same as :meth:`on_train_end`; safe to call twice.

        Every step runs even if one before it failed (a clock reset that fails, Ctrl-C in
        the flush): threads stopped, controller stopped, connections closed; the error is
        raised once all have run.
        """
        if self._closed:
            return
        self._closed = True
        self._at_exit.cancel()
        with contextlib.ExitStack() as steps:  # run last-pushed first, each whatever happens
            steps.callback(self.client.close)
            steps.callback(self._close_energy_source)
            steps.callback(self.controller.stop)
            if self._clocks is not None:
                # Its last requests reach the controller before the controller stops.
                steps.callback(self._clocks.stop)
            steps.callback(self._finish_rank)
            steps.callback(self.watcher.stop)
            steps.callback(self.reporter.stop)
            self._results.flush()

    def _close_at_exit(self) -> None:
        if os.getpid() != self._pid:
            return  # a fork's copy: the rank trains on in this hook's own process
        logger.info("rank %d: closing the hook at exit (close() was not called)", self.rank)
        try:
            self.close()
        except Exception:  # the interpreter is going down: say it, never mask its exit status
            logger.exception("rank %d: closing the hook at exit failed", self.rank)

    def _close_energy_source(self) -> None:
        close = getattr(self.energy_source, "close", None)
        if self._owned_source and close is not None:
            close()

    def _finish_rank(self) -> None:
        # Read once the reporter and the watcher have stopped: what they could not send counts.
        reachable = self.watcher.outage.since is None and not self.reporter.unsent
        finish_rank(self.client, self.job_id, self.rank, reachable)
