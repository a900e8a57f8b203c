"""Run a pure-pipeline scheduler on a 3D-parallel (data, tensor and pipeline parallel) job.

Every rank of a pipeline stage runs the same instructions, so it can run the same frequency
schedule. :func:`make_3d_parallel` wraps a scheduler so that it sees one representative rank
per stage: profiling results of a stage's ranks are merged into one (the stage is as slow as
its slowest rank and uses the energy of all its ranks), and the stage's schedule is copied to
each of its ranks.
"""

from __future__ import annotations

import inspect
import itertools
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from protocol.exceptions import ConfigError, ProtocolError
from protocol.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from protocol.rank_lists import NAMED, few_ranks
from protocol.scheduler import FrequencyScheduler, constructor_signature

S = TypeVar("S", bound=FrequencyScheduler)


def check_rank_infos(job_info: JobInfo, rank_infos: Sequence[RankInfo]) -> list[RankInfo]:
    """Check that ``rank_infos`` describe every rank of the job exactly once.

    Returns:
        The rank infos sorted by rank.

    Raises:
        ProtocolError: A rank is missing, duplicated or does not fit the job's degrees, or
            two ranks claim the same (dp, pp, tp) coordinates.

    """
    ranks = sorted(rank_infos, key=lambda r: r.rank)
    seen = [r.rank for r in ranks]
    # Counted once: a count per rank took minutes for a job of 100,000 (the default limit).
    duplicates = sorted(r for r, n in Counter(seen).items() if n > 1)
    if duplicates:
        raise ProtocolError(
            f"job {job_info.job_id}: ranks [{few_ranks(duplicates)}] registered twice"
        )
    missing = sorted(set(range(job_info.world_size)) - set(seen))
    if missing:
        raise ProtocolError(
            f"job {job_info.job_id}: ranks [{few_ranks(missing)}] have not registered"
        )
    holder: dict[tuple[int, int, int], int] = {}
    for info in ranks:
        try:
            info.check_fits(job_info)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        # Each (dp, pp, tp) position is one GPU's: two ranks there leave another empty.
        where = (info.dp_rank, info.pp_rank, info.tp_rank)
        if where in holder:
            raise ProtocolError(
                f"job {job_info.job_id}: ranks {holder[where]} and {info.rank} both registered "
                f"as dp_rank {where[0]}, pp_rank {where[1]}, tp_rank {where[2]} (give each rank "
                "its own data/pipeline/tensor parallel coordinates)"
            )
        holder[where] = info.rank
    return ranks


def common_frequencies(job_id: str, stage: int, members: Sequence[RankInfo]) -> list[int]:
    """Frequencies every rank of pipeline stage ``stage`` (its ``members``) supports.

    Returns:
        The frequencies, highest first.

    Raises:
        ConfigError: The stage's ranks have no frequency in common.

    """
    common = set(members[0].available_frequencies)
    for info in members[1:]:
        common &= set(info.available_frequencies)
    if not common:
        raise ConfigError(
            f"job {job_id}: the ranks of stage {stage} ([{few_ranks([i.rank for i in members])}]) "
            "have no GPU frequency in common"
        )
    return sorted(common, reverse=True)


class _ThreeDParallel(FrequencyScheduler):
    """Mixin placed before the wrapped scheduler in the MRO by :func:`make_3d_parallel`.

    After construction, ``job_info``, ``rank_infos`` and ``world_size`` describe the pipeline
    the wrapped scheduler sees; ``real_job_info`` and ``real_rank_infos`` describe the job.
    """

    def __init__(
        self, job_info: JobInfo, rank_infos: list[RankInfo], *args: Any, **kwargs: Any
    ) -> None:
        self.real_job_info = job_info
        self.real_rank_infos = check_rank_infos(job_info, rank_infos)
        self._stage_of = {r.rank: r.pp_rank for r in self.real_rank_infos}
        self._stage_ranks: dict[int, list[int]] = defaultdict(list)
        for info in self.real_rank_infos:
            self._stage_ranks[info.pp_rank].append(info.rank)
        pp = job_info.pp_degree
        stage_job = JobInfo(
            job_id=job_info.job_id,
            pp_degree=pp,
            dp_degree=1,
            tp_degree=1,
            world_size=pp,
            job_metadata=job_info.job_metadata,
        )
        stage_ranks = [
            RankInfo(
                rank=s,
                dp_rank=0,
                pp_rank=s,
                tp_rank=0,
                available_frequencies=self._stage_frequencies(s),
            )
            for s in range(pp)
        ]
        super().__init__(stage_job, stage_ranks, *args, **kwargs)

    def _stage_frequencies(self, stage: int) -> list[int]:
        """Frequencies every rank of ``stage`` supports, highest first."""
        members = [self.real_rank_infos[r] for r in self._stage_ranks[stage]]
        return common_frequencies(self.real_job_info.job_id, stage, members)

    def observe(self, profiling_results: list[ProfilingResult]) -> None:
        """Merge the results of each stage's ranks and pass one result per stage on."""
        by_stage: dict[int, list[ProfilingResult]] = defaultdict(list)
        seen: set[int] = set()
        for result in profiling_results:
            stage = self._stage_of.get(result.rank)
            if stage is None:
                raise ProtocolError(
                    f"job {self.real_job_info.job_id}: result from unknown rank {result.rank}"
                )
            if result.rank in seen:
                raise ProtocolError(
                    f"job {self.real_job_info.job_id}: two results from rank {result.rank}"
                )
            seen.add(result.rank)
            by_stage[stage].append(result)
        missing = sorted(set(self._stage_of) - seen)
        if missing:
            raise ProtocolError(
                f"job {self.real_job_info.job_id}: no profiling results from ranks "
                f"[{few_ranks(missing)}]"
            )
        merged = [merge_stage_results(s, by_stage[s]) for s in sorted(by_stage)]
        super().observe(merged)

    def next_schedule(self) -> list[FrequencySchedule]:
        """Copy each stage's schedule to every rank of that stage."""
        per_stage = super().next_schedule()
        by_stage = {sched.rank: sched for sched in per_stage}
        pp = self.real_job_info.pp_degree
        if len(per_stage) != pp or set(by_stage) != set(range(pp)):
            raise ProtocolError(
                f"{type(self).__name__}: expected one schedule for each of {pp} stages, got "
                f"ranks [{few_ranks(sorted(sched.rank for sched in per_stage))}]"
            )
        return [
            FrequencySchedule(
                rank=info.rank,
                frequencies=list(by_stage[info.pp_rank].frequencies),
                version=by_stage[info.pp_rank].version,
            )
            for info in self.real_rank_infos
        ]


def merge_stage_results(stage: int, results: Sequence[ProfilingResult]) -> ProfilingResult:
    """Merge the profiling results of the ranks of one stage into one result.

    Per profiled iteration, the stage's time is the maximum over its ranks and its energy is
    the sum. Time breakdowns merge elementwise with max, energy breakdowns with sum.

    Args:
        stage: The stage (becomes the merged result's rank).
        results: One result per rank of the stage, all for the same schedule version.

    Raises:
        ProtocolError: No results, different schedule versions, different numbers of
            iterations, or breakdowns of different shapes.

    """
    if not results:
        raise ProtocolError(f"stage {stage}: no profiling results to merge")
    ranks = [r.rank for r in results]
    versions = {r.schedule_version for r in results}
    if len(versions) > 1:
        detail = _grouped((r.rank, r.schedule_version) for r in results)
        raise ProtocolError(f"stage {stage}: ranks report different schedule versions ({detail})")
    lengths = {len(r.iter_time) for r in results}
    if len(lengths) > 1:
        detail = _grouped((r.rank, len(r.iter_time)) for r in results)
        raise ProtocolError(
            f"stage {stage}: ranks report different numbers of iterations ({detail})"
        )
    return ProfilingResult(
        rank=stage,
        schedule_version=results[0].schedule_version,
        iter_time=[max(values) for values in zip(*(r.iter_time for r in results), strict=True)],
        iter_energy=[sum(values) for values in zip(*(r.iter_energy for r in results), strict=True)],
        time_breakdown=_merge_breakdowns(
            stage, "time_breakdown", ranks, [r.time_breakdown for r in results], max
        ),
        energy_breakdown=_merge_breakdowns(
            stage, "energy_breakdown", ranks, [r.energy_breakdown for r in results], sum
        ),
    )


def _merge_breakdowns(
    stage: int,
    what: str,
    ranks: list[int],
    breakdowns: list[dict[str, list[list[float]]]],
    combine: Callable[[tuple[float, ...]], float],
) -> dict[str, list[list[float]]]:
    """Combine ``breakdown[instruction][iteration][index]`` across ranks with ``combine``."""
    keys = {frozenset(b) for b in breakdowns}
    if len(keys) > 1:
        detail = _grouped((r, sorted(b)) for r, b in zip(ranks, breakdowns, strict=True))
        raise ProtocolError(f"stage {stage}: {what} covers different instructions ({detail})")
    merged: dict[str, list[list[float]]] = {}
    for name in breakdowns[0]:
        shapes = {tuple(len(it) for it in b[name]) for b in breakdowns}
        if len(shapes) > 1:
            raise ProtocolError(
                f"stage {stage}: {what}[{name!r}] has different shapes across ranks "
                f"[{few_ranks(ranks)}]"
            )
        merged[name] = [
            [combine(values) for values in zip(*iterations, strict=True)]
            for iterations in zip(*(b[name] for b in breakdowns), strict=True)
        ]
    return merged


def _grouped(pairs: Iterable[tuple[int, Any]]) -> str:
    """``(rank, value)`` pairs as each value and a few of its ranks: ``1: ranks [0, 2]; 2: rank 1``.

    At most :data:`~protocol.rank_lists.NAMED` values, each with a few ranks, so that a stage
    of thousands of ranks does not make a message of kilobytes.
    """
    by_value: dict[str, list[int]] = {}
    for rank, value in pairs:
        by_value.setdefault(str(value), []).append(rank)
    parts = [
        f"{value}: ranks [{few_ranks(ranks)}]" if len(ranks) > 1 else f"{value}: rank {ranks[0]}"
        for value, ranks in itertools.islice(by_value.items(), NAMED)
    ]
    if len(by_value) > NAMED:
        parts.append(f"... and {len(by_value) - NAMED:,} more values")
    return "; ".join(parts)


def is_3d_parallel(cls: type) -> bool:
    """Whether ``cls`` was made by :func:`make_3d_parallel` (a rank runs its stage's line)."""
    return issubclass(cls, _ThreeDParallel)


def make_3d_parallel(sched_cls: type[S], name: str | None = None) -> type[S]:
    """Wrap a pure-pipeline scheduler so that it runs 3D-parallel jobs.

    The returned subclass of ``sched_cls`` shows the wrapped scheduler a pipeline of
    ``pp_degree`` stages, one rank per stage (rank ``s`` is stage ``s``), whose available
    frequencies are those all of the stage's ranks support. ``observe`` merges each stage's
    results with :func:`merge_stage_results`; ``next_schedule`` copies stage ``s``'s schedule
    to every rank with ``pp_rank == s``. Everything else, ``set_target`` included, is the
    wrapped scheduler's.

    Args:
        sched_cls: The scheduler class to wrap.
        name: Name of the new class; ``<sched_cls name>3D`` if None.

    Returns:
        The new scheduler class. Its signature is ``sched_cls``'s, so scheduler arguments are
        checked the same way.

    Raises:
        ConfigError: ``sched_cls`` is not a FrequencyScheduler or is already 3D-parallel.

    """
    if not (inspect.isclass(sched_cls) and issubclass(sched_cls, FrequencyScheduler)):
        raise ConfigError(f"{sched_cls!r} is not a FrequencyScheduler subclass")
    if issubclass(sched_cls, _ThreeDParallel):
        raise ConfigError(f"{sched_cls.__name__} is already 3D-parallel")
    cls_name = name or f"{sched_cls.__name__}3D"
    namespace: dict[str, Any] = {
        "__doc__": "[3D-parallel] " + (sched_cls.__doc__ or ""),
        "__module__": sched_cls.__module__,
        "__qualname__": cls_name,
        # inspect.signature (and so registry.check_scheduler_args) reads this instead of the
        # mixin's catch-all ``*args, **kwargs``; its annotations are evaluated in the
        # scheduler's own module, for the check of argument types.
        "__signature__": constructor_signature(sched_cls),
    }
    new_cls = type(cls_name, (_ThreeDParallel, sched_cls), namespace)
    return new_cls
