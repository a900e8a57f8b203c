"""Profile every stage's forward and backward at each clock during training (Perseus step 1).

:class:`InstructionProfiler` is a frequency scheduler whose schedules *are* the profiling
sweep. Each (stage, instruction) pair has its own sweep over the stage's clocks, high to low;
schedule version ``k`` runs every forward of a stage at that stage's ``k``-th forward clock and
every backward at its ``k``-th backward clock, in the job's pipeline order (1F1B or GPipe).
From each version's results (which the hook must report with ``instruction_energy=True``)
the profiler drops the first ``warmup_iters`` iterations, averages each instruction's time and
energy over the remaining iterations and instances, and over the data/tensor-parallel ranks of
the stage (each runs the same instruction on its own GPU). Following the Perseus docs, a sweep
stops once energy has risen ``stop_after_rises`` times in a row (lower clocks only cost more
time *and* energy) or at the lowest clock; a stopped instruction then runs at the stage's
highest clock, unmeasured.

When every sweep has stopped, the profile is written as a full-form CSV (one row group per
rank with that rank's own figures; :mod:`schedulers.planning.profile_csv`), and then either

* without ``then``: every instruction runs at its highest clock, forever; or
* with ``then``: the planner computes the frontier from the CSV
  (:mod:`schedulers.planning.planner`),
  a policy picks a plan (:mod:`schedulers.planning.choose`) and that plan is served forever: the
  automatic profile -> optimize -> serve path.

The profiler snapshots (its sweeps and per-rank averages, see :meth:`InstructionProfiler.snapshot`),
so a worker that starts afresh restores the newest snapshot and replays only the journal
after it, and the results it consumed are deleted. Restoring or replaying past the end of the
sweep runs its end (CSV write, planning) again. Both are idempotent and cheap then: the CSV is
replaced only if its content changed, and planning is skipped when the job's planner folder
(``<out_dir>/<job id>/``) already holds a frontier computed from the same CSV content and
parameters (a hash recorded in ``.instruction_profiler.json`` there after the planner
finished). Paths are as seen by the rq workers.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

from protocol.constants import INSTRUCTIONS
from protocol.exceptions import ConfigError, ProtocolError
from protocol.models import (
    FrequencySchedule,
    JobInfo,
    OfflineProfilingResult,
    ProfilingResult,
    RankInfo,
)
from protocol.pipeline_schedules import DEFAULT_SCHEDULE, check_schedule, stage_order
from protocol.rank_lists import few_ranks
from protocol.scheduler import FrequencyScheduler
from schedulers.parallel3d import check_rank_infos, common_frequencies
from schedulers.planning.choose import ChosenPlan
from schedulers.planning.frontier_compute import p2p_unset_note
from schedulers.planning.profile_writer import write_profile_csv
from schedulers.profile_then import (
    MEASURED_PROFILE,
    ThenArgs,
    check_then,
    check_then_size,
    plan_in_folder,
    write_if_changed,
)
from schedulers.profiler_args import (
    check_counts,
    check_frequencies,
    check_rank_clocks,
    check_writable,
)
from schedulers.profiler_measures import (
    Sweep,
    check_every_instruction,
    check_per_microbatch,
    instruction_average,
)

Key = tuple[int, str]  # (stage, instruction)

logger = logging.getLogger(__name__)

PROFILE_ARTIFACT = "profile.csv"
"""The artifact name under which a finished sweep stores its profile (``perseus profile``)."""


class InstructionProfiler(FrequencyScheduler):
    """Sweep each stage's forward and backward clocks, write the profile, then serve.

    Args:
        job_info: The training job (any dp/tp degree).
        rank_infos: Every rank of the job.
        microbatches: Microbatches per iteration (the instruction order depends on it).
        warmup_iters: Iterations of each version's results to ignore (clock changes,
            caches); the hook's ``report_every`` must be larger.
        stop_after_rises: Stop a sweep after this many consecutive energy rises.
        frequencies: Sweep only these clocks (MHz; each must be supported by every GPU).
            Default: each stage's clocks common to its ranks.
        then: Plan and serve a plan once profiled: ``{"out_dir": DIR, "p2p_power": W,
            "unit_time": s, "policy": "no-slowdown", "policy_arg": None,
            "max_instructions": 100_000}`` (only ``out_dir`` is required; defaults 0 W,
            1 ms, no-slowdown, 100,000; a planner run with ``p2p_power`` left out logs a
            warning that waiting counts as free). ``max_instructions`` bounds the planned
            pipeline, ``2 * pp_degree * microbatches``: checked when the coordinator starts
            (for one stage), when a job registers and when the profiler is built, not
            after the sweep. Each job
            plans in its own folder, ``<out_dir>/<job id>/``, from the profile it measured
            (``measured_profile.csv`` there): jobs never share planner files.
        out_path: Also write the profile CSV (full form, one row group per rank) here. The
            profile is always kept with the job in Redis as the artifact ``profile.csv``
            (``perseus dump`` writes it out).
        schedule: The pipeline schedule the training runs, ``"1f1b"`` or ``"gpipe"``: the
            order of every version's instructions, and the schedule ``then`` plans for.

    Raises:
        ConfigError: Bad arguments, or a restricted clock a stage's GPUs do not support.
        ProtocolError: Missing or duplicate ranks.

    """

    needs_instruction_energy = True
    server_path_args = frozenset({"out_path", "then"})  # then names an output folder

    @classmethod
    def check_result(cls, result: ProfilingResult) -> None:
        """Also every instruction must be there: without one, the sweep could not go on.

        Dead-lettered at the coordinator instead of failing the job (a loop that missed an
        ``on_instruction_end``, say).
        """
        super().check_result(result)
        check_every_instruction(result)

    @classmethod
    def check_job_result(cls, result: ProfilingResult, args: dict[str, Any]) -> None:
        """Also what the sweep needs: each instruction once per microbatch, past warm-up.

        Every iteration must hold ``microbatches`` times of each instruction, and one must
        come after the ``warmup_iters`` ones (see
        :func:`~schedulers.profiler_measures.instruction_average`). Such a result reached
        the sweep and failed the job for good; refused here, it is dead-lettered and the
        rank's next good result for the version is taken.
        """
        super().check_job_result(result, args)
        check_per_microbatch(result, args)

    @classmethod
    def absolute_paths(cls, args: dict[str, Any]) -> dict[str, Any]:
        """Also ``then``'s ``out_dir``, the planner's output folder."""
        out = super().absolute_paths(args)
        then = out.get("then")
        if isinstance(then, dict) and isinstance(then.get("out_dir"), str):
            out["then"] = {**then, "out_dir": os.path.abspath(then["out_dir"])}
        return out

    @classmethod
    def check_args(cls, args: dict[str, Any]) -> None:
        """The counts, the schedule and ``then`` (at coordinator start and registration)."""
        microbatches = args.get("microbatches", 1)
        check_counts(microbatches, args.get("warmup_iters", 1), args.get("stop_after_rises", 5))
        check_schedule(args.get("schedule", DEFAULT_SCHEDULE))
        then = check_then(args.get("then"))
        if then is not None:
            check_then_size(then, None, microbatches)
        check_frequencies(args.get("frequencies"))

    @classmethod
    def check_job(cls, args: dict[str, Any], job: JobInfo) -> None:
        """With ``then``: the job's stages times ``microbatches`` within the planner's bound."""
        then = check_then(args.get("then"))
        if then is not None:
            check_then_size(then, job.pp_degree, args.get("microbatches", 1))

    @classmethod
    def check_files(cls, args: dict[str, Any]) -> None:
        """``out_path`` and ``then``'s folder must be writable where they are.

        They are written once the sweep ends: a folder given as ``out_path``, or a file as
        ``then``'s ``out_dir``, failed the job then, after the whole sweep.
        """
        out_path = args.get("out_path")
        if isinstance(out_path, str):
            check_writable("out_path", Path(out_path), folder=False)
        then = args.get("then")
        if isinstance(then, dict) and isinstance(then.get("out_dir"), str):
            check_writable("then['out_dir']", Path(then["out_dir"]), folder=True)

    @classmethod
    def sweep_versions(cls, args: dict[str, Any], frequencies: int) -> int | None:
        """One version per clock swept (every stage and instruction sweeps at once).

        A rank's stage sweeps at most its own clocks, or the ``frequencies`` argument's if
        given; energy rises may stop it sooner.
        """
        restrict = args.get("frequencies")
        if isinstance(restrict, list | tuple):
            return min(frequencies, len(set(restrict)))
        return frequencies

    @classmethod
    def check_rank(cls, args: dict[str, Any], rank: RankInfo) -> None:
        """Every clock of ``frequencies`` must be the rank's (else the job failed later)."""
        check_rank_clocks(cls.__name__, args.get("frequencies"), rank)

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: list[RankInfo],
        microbatches: int,
        warmup_iters: int = 1,
        stop_after_rises: int = 5,
        frequencies: list[int] | None = None,
        then: ThenArgs | None = None,
        out_path: str | None = None,
        schedule: str = DEFAULT_SCHEDULE,
    ) -> None:
        super().__init__(job_info, rank_infos)
        self.schedule = check_schedule(schedule)
        check_counts(microbatches, warmup_iters, stop_after_rises)
        self.microbatches = microbatches
        self.warmup_iters = warmup_iters
        self.stop_after_rises = stop_after_rises
        self.then = check_then(then)
        if self.then is not None:  # Not found after the sweep, when the planner starts.
            check_then_size(self.then, job_info.pp_degree, microbatches)
        self._p2p_unset = then is not None and "p2p_power" not in then
        self.out_path = Path(out_path) if out_path is not None else None
        # A folder per job: two jobs of one coordinator plan side by side, each from its own
        # profile (one folder for all would let a job plan from, or overwrite, another's).
        self.plan_dir = (
            Path(self.then["out_dir"]) / job_info.job_id if self.then is not None else None
        )
        self.ranks = check_rank_infos(job_info, rank_infos)
        pp = job_info.pp_degree
        self.stage_ranks: dict[int, list[RankInfo]] = {s: [] for s in range(pp)}
        for info in self.ranks:
            self.stage_ranks[info.pp_rank].append(info)
        self.order = {s: stage_order(schedule, pp, microbatches, s) for s in range(pp)}
        self.max_frequency: dict[int, int] = {}
        self.sweeps: dict[Key, Sweep] = {}
        for stage in range(pp):
            clocks = self._sweep_clocks(stage, frequencies)
            self.max_frequency[stage] = self._common_clocks(stage)[0]
            for inst in INSTRUCTIONS:
                self.sweeps[(stage, inst)] = Sweep(list(clocks))
        # rank -> (instruction, frequency) -> (time s, energy J), that rank's own averages.
        self.rank_data: dict[int, dict[tuple[str, int], tuple[float, float]]] = {
            info.rank: {} for info in self.ranks
        }
        self.done = False
        self.chosen: ChosenPlan | None = None
        self.planned = False  # Whether this instance ran the planner (False: cache hit).

    # --- setup -------------------------------------------------------------------------------
    def _common_clocks(self, stage: int) -> list[int]:
        return common_frequencies(self.job_info.job_id, stage, self.stage_ranks[stage])

    def _sweep_clocks(self, stage: int, restrict: Sequence[int] | None) -> list[int]:
        common = self._common_clocks(stage)
        if restrict is None:
            return common
        wanted = {int(f) for f in restrict}
        unsupported = sorted(wanted - set(common), reverse=True)
        if unsupported:
            raise ConfigError(
                f"frequencies {unsupported} MHz are not supported by every GPU of stage {stage} "
                f"({common[0]}..{common[-1]} MHz, {len(common)} clocks)"
            )
        if not wanted:
            raise ConfigError("frequencies is empty: give at least one clock to profile")
        return [f for f in common if f in wanted]

    # --- the sweep ----------------------------------------------------------------------------
    def _schedules(self, clocks: dict[Key, int]) -> list[FrequencySchedule]:
        """Every rank's schedule: its stage's instructions at ``clocks`` (else the max)."""
        out = []
        for info in self.ranks:
            stage = info.pp_rank
            top = self.max_frequency[stage]
            pairs = [(name, clocks.get((stage, name), top)) for name in self.order[stage]]
            out.append(FrequencySchedule(rank=info.rank, frequencies=pairs))
        return out

    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        """Yield one version per sweep step, then the final schedules."""
        while not all(s.stopped for s in self.sweeps.values()):
            measuring = {key: s.current for key, s in self.sweeps.items() if not s.stopped}
            results = yield self._schedules(measuring)
            self._observe(results, measuring)
        self.write_csv()
        self.done = True
        yield self._planned_schedules() if self.then is not None else self._schedules({})

    def _observe(self, results: list[ProfilingResult], measuring: dict[Key, int]) -> None:
        by_rank: dict[int, ProfilingResult] = {}
        for res in results:
            if res.rank in by_rank:
                raise ProtocolError(f"two profiling results from rank {res.rank}")
            by_rank[res.rank] = res
        missing = sorted(set(self.rank_data) - set(by_rank))
        if missing:
            raise ProtocolError(f"no profiling results from ranks [{few_ranks(missing)}]")
        for (stage, inst), freq in measuring.items():
            figures = []
            for info in self.stage_ranks[stage]:
                t, e = instruction_average(
                    by_rank[info.rank],
                    stage,
                    inst,
                    self.order[stage].count(inst),
                    self.warmup_iters,
                    self.microbatches,
                )
                self.rank_data[info.rank][(inst, freq)] = (t, e)
                figures.append((t, e))
            stage_energy = math.fsum(e for _, e in figures) / len(figures)
            self.sweeps[(stage, inst)].record(freq, stage_energy, self.stop_after_rises)

    # --- snapshots ----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The sweeps and per-rank averages so far, and how far the schedules got.

        Taken between versions (results observed, next schedules computed): the generator
        is then waiting for results of the schedules that the sweeps' state determines, so
        :meth:`restore` can start a new one at the same point.
        """
        return {
            "started": self._generator is not None,
            "finished": self._finished,
            "sweeps": [
                [stage, inst, s.frequencies, s.measured, s.energies, s.rises, s.stopped]
                for (stage, inst), s in self.sweeps.items()
            ],
            "rank_data": [
                [rank, [[inst, freq, t, e] for (inst, freq), (t, e) in data.items()]]
                for rank, data in self.rank_data.items()
            ],
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`snapshot`'s ``state`` (right after construction).

        Raises:
            ValueError: The state is not one of this profiler's (other stages, clocks or
                ranks: the job's arguments changed).
        """
        sweeps = {(int(row[0]), str(row[1])): row[2:] for row in state["sweeps"]}
        if set(sweeps) != set(self.sweeps):
            raise ValueError(f"snapshot sweeps {sorted(sweeps)}, expected {sorted(self.sweeps)}")
        for key, (freqs, measured, energies, rises, stopped) in sweeps.items():
            sweep = self.sweeps[key]
            if [int(f) for f in freqs] != sweep.frequencies:
                raise ValueError(f"snapshot sweeps other clocks for stage {key[0]} {key[1]}")
            sweep.measured = [int(f) for f in measured]
            sweep.energies = [float(e) for e in energies]
            sweep.rises, sweep.stopped = int(rises), bool(stopped)
        ranks = {int(rank): rows for rank, rows in state["rank_data"]}
        if set(ranks) != set(self.rank_data):
            have, expected = few_ranks(sorted(ranks)), few_ranks(sorted(self.rank_data))
            raise ValueError(f"snapshot has ranks [{have}], expected [{expected}]")
        self.rank_data = {
            rank: {(str(i), int(f)): (float(t), float(e)) for i, f, t, e in ranks[rank]}
            for rank in self.rank_data
        }
        if state["started"]:
            # The generator resumes where the sweeps are: it yields the schedules the snapshot's
            # version serves (past the end: writes the CSV and plans again, both idempotent).
            self._generator = self._run()
            self._next = next(self._generator)
            self._finished = bool(state["finished"])

    # --- outputs ------------------------------------------------------------------------------
    def profile_results(self) -> list[OfflineProfilingResult]:
        """Per-rank averages measured so far (what :meth:`write_csv` writes)."""
        out = []
        for info in self.ranks:
            data = self.rank_data[info.rank]
            per: dict[str, dict[int, float]] = {}
            for (inst, freq), (t, e) in data.items():
                per.setdefault(f"{inst}_time", {})[freq] = t
                per.setdefault(f"{inst}_energy", {})[freq] = e
            out.append(
                OfflineProfilingResult(
                    rank=info.rank,
                    dp_rank=info.dp_rank,
                    pp_rank=info.pp_rank,
                    tp_rank=info.tp_rank,
                    forward_time=per.get("forward_time", {}),
                    forward_energy=per.get("forward_energy", {}),
                    backward_time=per.get("backward_time", {}),
                    backward_energy=per.get("backward_energy", {}),
                )
            )
        return out

    def csv_bytes(self) -> bytes:
        """The profile CSV (full form) measured so far."""
        with tempfile.TemporaryDirectory(prefix="perseus-profile-") as tmp:
            path = Path(tmp) / "profile.csv"
            write_profile_csv(path, self.profile_results())
            return path.read_bytes()

    def artifacts(self) -> dict[str, bytes]:
        """``profile.csv`` once profiling is done."""
        return {PROFILE_ARTIFACT: self.csv_bytes()} if self.done else {}

    def write_csv(self) -> None:
        """Write the profile to ``out_path`` and the job's planner folder (if any)."""
        paths = [self.out_path] if self.out_path is not None else []
        if self.plan_dir is not None:
            paths.append(self.plan_dir / MEASURED_PROFILE)
        if paths:
            data = self.csv_bytes()
            for path in paths:
                write_if_changed(path, data)

    def _planned_schedules(self) -> list[FrequencySchedule]:
        """Plan from the CSV (unless cached), choose a plan, and give each rank its stage's line."""
        assert self.then is not None and self.plan_dir is not None
        self.chosen, plan, planned = plan_in_folder(
            self.plan_dir, self.then, self.job_info.pp_degree, self.microbatches, self.schedule
        )
        self.planned = self.planned or planned
        if planned and self._p2p_unset:
            note = p2p_unset_note(f"{type(self).__name__}'s then.p2p_power")
            logger.warning("job %s: %s", self.job_info.job_id, note)
        return [
            FrequencySchedule(rank=info.rank, frequencies=list(plan.stages[info.pp_rank]))
            for info in self.ranks
        ]
