"""Small deterministic schedulers used by the coordinator tests (``tests.toy_schedulers:X``)."""

from __future__ import annotations

import time
from collections.abc import Generator
from pathlib import Path as RuntimePath  # evaluated at run time (JsonShaped); Path is not
from typing import TYPE_CHECKING

from typing_extensions import NotRequired, TypedDict

from protocol.exceptions import ConfigError
from protocol.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from protocol.scheduler import FrequencyScheduler
from schedulers.planning.plan_file import parse_plan_text

if TYPE_CHECKING:
    from pathlib import Path


class StepDown(FrequencyScheduler):
    """Every rank runs ``forward, backward`` x microbatches; each round lowers the clock one step.

    Deterministic, so replay from the journal reproduces every version exactly.
    """

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: list[RankInfo],
        microbatches: int = 2,
        delay: float = 0.0,
    ) -> None:
        super().__init__(job_info, rank_infos)
        self.microbatches = microbatches
        self.delay = delay
        self.observed: list[list[ProfilingResult]] = []
        self.targets: list[float] = []

    def _schedules(self, step: int) -> list[FrequencySchedule]:
        out = []
        for info in self.rank_infos:
            freqs = info.available_frequencies
            freq = freqs[min(step, len(freqs) - 1)]
            names = ["forward", "backward"] * self.microbatches
            out.append(FrequencySchedule(rank=info.rank, frequencies=[(n, freq) for n in names]))
        return out

    def set_target(self, iteration_time: float) -> None:
        self.targets.append(iteration_time)

    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        step = 0
        while True:
            if self.delay:
                time.sleep(self.delay)  # Gives fault tests time to kill a worker mid-job.
            results = yield self._schedules(step + len(self.targets))
            self.observed.append(results)
            step += 1


class Broken(FrequencyScheduler):
    """Always fails, to check that scheduler errors reach the clients."""

    def next_schedule(self) -> list[FrequencySchedule]:
        raise RuntimeError("this scheduler is broken on purpose")


class WrongRank(FrequencyScheduler):
    """Returns rank 0's schedule under every rank's slot but labelled rank 0."""

    def next_schedule(self) -> list[FrequencySchedule]:
        freq = self.rank_infos[0].available_frequencies[0]
        return [FrequencySchedule(rank=0, frequencies=[("forward", freq)])]


class DropsLastRank(StepDown):
    """StepDown's schedules but the last rank's (a scheduler that lost one)."""

    def next_schedule(self) -> list[FrequencySchedule]:
        return super().next_schedule()[:-1]


class WithArtifact(StepDown):
    """StepDown that also leaves a small artifact."""

    def artifacts(self) -> dict[str, bytes]:
        return {"note.txt": b"made by version 1"}


class SnapshotStepDown(StepDown):
    """StepDown written without a generator, so its state snapshots: a step count and targets.

    Each observation lowers the clock one step, and so does each target; the schedule is
    recomputed on every call. It keeps no results (a worker's memory stays flat too).
    """

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: list[RankInfo],
        microbatches: int = 2,
        delay: float = 0.0,
    ) -> None:
        super().__init__(job_info, rank_infos, microbatches, delay)
        self.step = 0
        self.restored_from: int | None = None  # the step of the snapshot it started from

    def observe(self, profiling_results: list[ProfilingResult]) -> None:
        self.step += 1

    def next_schedule(self) -> list[FrequencySchedule]:
        if self.delay:
            time.sleep(self.delay)
        return self._schedules(self.step + len(self.targets))

    def snapshot(self) -> dict:
        return {"step": self.step, "targets": self.targets}

    def restore(self, state: dict) -> None:
        self.step = self.restored_from = int(state["step"])
        self.targets = [float(t) for t in state["targets"]]


class FailsAfterFirst(StepDown):
    """Serves one version, then fails on the results: a scheduler failure mid-training."""

    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        yield self._schedules(0)
        raise RuntimeError("this scheduler fails after its first version on purpose")


class RefusesSlowTargets(SnapshotStepDown):
    """Takes targets of at most 10 s; refuses slower ones (as a frontier refuses a bad plan)."""

    def set_target(self, iteration_time: float) -> None:
        if iteration_time > 10:
            raise ConfigError(f"no plan for an iteration time of {iteration_time} s")
        super().set_target(iteration_time)


class NeedsInstructionEnergy(StepDown):
    """StepDown that asks for per-instruction energy, as InstructionProfiler does."""

    needs_instruction_energy = True


class PlanSequence(FrequencyScheduler):
    """Serves plan texts in turn, one version per round of results, then the last forever.

    Rank ``r`` runs line ``r`` of each plan (a pure pipeline job).
    """

    def __init__(self, job_info: JobInfo, rank_infos: list[RankInfo], plans: list[str]) -> None:
        super().__init__(job_info, rank_infos)
        self.plans = [parse_plan_text(text, source=f"<plan {i}>") for i, text in enumerate(plans)]

    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        for plan in self.plans:
            yield [
                FrequencySchedule(rank=rank, frequencies=list(stage))
                for rank, stage in enumerate(plan.stages)
            ]


class ZeusStyle(StepDown):
    """A scheduler written for Zeus's server: its constructor takes ``pfo_settings``."""

    def __init__(self, job_info: JobInfo, rank_infos: list[RankInfo], pfo_settings: object) -> None:
        super().__init__(job_info, rank_infos)


class ThenArgs(TypedDict):
    """A nested argument with typed keys (pydantic needs typing_extensions' TypedDict on 3.11)."""

    out_dir: str
    p2p_power: NotRequired[float]


class JsonShaped(StepDown):
    """Arguments whose types JSON writes otherwise: a path as a string, a tuple as a list."""

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: list[RankInfo],
        folder: RuntimePath | None = None,
        pair: tuple[int, int] = (1, 2),
        scale: float = 1.0,
    ) -> None:
        super().__init__(job_info, rank_infos)
        self.folder, self.pair, self.scale = folder, pair, scale


class TypedArgs(StepDown):
    """StepDown with a TypedDict argument and one annotated with a type-checking-only name."""

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: list[RankInfo],
        then: ThenArgs | None = None,
        where: Path | None = None,
    ) -> None:
        super().__init__(job_info, rank_infos)
        self.then = then


class FailsWhileFlagged(FrequencyScheduler):
    """One plan for ever; computing it fails while the file ``flag`` exists.

    A failure from outside the job that an operator can mend (a missing or unreadable file,
    say), so that a failed task can then be requeued and succeed.
    """

    def __init__(self, job_info: JobInfo, rank_infos: list[RankInfo], flag: str) -> None:
        super().__init__(job_info, rank_infos)
        self.flag = RuntimePath(flag)

    @property
    def converged(self) -> bool:
        return True

    def observe(self, profiling_results: list[ProfilingResult]) -> None:
        """Results change nothing."""

    def next_schedule(self) -> list[FrequencySchedule]:
        if self.flag.exists():
            raise RuntimeError(f"{self.flag} is in the way")
        return [
            FrequencySchedule(
                rank=info.rank, frequencies=[("forward", info.available_frequencies[0])]
            )
            for info in self.rank_infos
        ]


class StepsUnlessFlagged(SnapshotStepDown):
    """SnapshotStepDown whose computing fails while the file ``flag`` exists (as FailsWhileFlagged).

    ``converged``: it keeps its first schedule, so later results only have their observation
    recorded (no new version).
    """

    def __init__(
        self, job_info: JobInfo, rank_infos: list[RankInfo], flag: str, converged: bool = False
    ) -> None:
        super().__init__(job_info, rank_infos)
        self.flag = RuntimePath(flag)
        self.stays = converged

    @property
    def converged(self) -> bool:
        return self.stays

    def next_schedule(self) -> list[FrequencySchedule]:
        if self.flag.exists():
            raise RuntimeError(f"{self.flag} is in the way")
        return self._schedules(0) if self.stays else super().next_schedule()
