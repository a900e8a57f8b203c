"""Serve one fixed frequency plan, read from a Perseus plan file.

``PointSolution`` is for pure pipeline-parallel jobs (one plan line per rank);
``PointSolution3D`` serves the same kind of plan to a 3D-parallel job by giving every rank of a
stage that stage's line.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Generator
from typing import Any

from protocol.exceptions import ConfigError, ProtocolError
from protocol.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from protocol.scheduler import FrequencyScheduler
from schedulers.parallel3d import check_rank_infos, is_3d_parallel, make_3d_parallel
from schedulers.planning.plan_file import PlanFile, parse_plan_text, read_plan_file


def check_plan_fits(
    plan: PlanFile,
    job: JobInfo,
    ranks: list[RankInfo],
    stage_of: Callable[[RankInfo], int],
    name: str,
    real_job: JobInfo | None = None,
) -> None:
    """Raise ConfigError unless ``plan`` has one line per rank and only supported clocks.

    Args:
        plan: The plan.
        job: The job it is for (as the scheduler sees it; 3D wrappers show a pipeline).
        ranks: The job's ranks.
        stage_of: Which plan line a rank runs.
        name: The scheduler, for the hint to use its 3D variant.
        real_job: The job itself, when ``job`` is a 3D wrapper's pipeline view of it (the
            message then describes the job the user started).
    """
    if plan.num_stages != job.world_size and real_job is not None and real_job != job:
        raise ConfigError(
            f"{plan.source}: plan has {plan.num_stages} stage lists but job {real_job.job_id} "
            f"needs {real_job.pp_degree}, one per pipeline stage (pp_degree="
            f"{real_job.pp_degree}; its {real_job.world_size} ranks, dp_degree="
            f"{real_job.dp_degree} x tp_degree={real_job.tp_degree} per stage, each run their "
            "stage's list)"
        )
    if plan.num_stages != job.world_size:
        hint = ""
        if job.dp_degree > 1 or job.tp_degree > 1:
            hint = f" (for data or tensor parallel jobs use {name}3D)"
        raise ConfigError(
            f"{plan.source}: plan has {plan.num_stages} stage lists but job "
            f"{job.job_id} needs {job.world_size}, one per rank (pp_degree={job.pp_degree}, "
            f"dp_degree={job.dp_degree}, tp_degree={job.tp_degree}){hint}"
        )
    for info in ranks:
        available = set(info.available_frequencies)
        for i, (inst, freq) in enumerate(plan.stages[stage_of(info)]):
            if freq not in available:
                raise ConfigError(
                    f"{plan.source}: rank {info.rank}, instruction {i} ({inst}): frequency "
                    f"{freq} MHz is not among the rank's available frequencies "
                    f"({max(available)}..{min(available)} MHz, {len(available)} values)"
                )


@functools.lru_cache(maxsize=8)
def _parsed_text(text: str) -> PlanFile:
    """A plan text parsed once for all of a job's registering ranks."""
    return parse_plan_text(text, source="<plan_text>")


@functools.lru_cache(maxsize=8)
def _parsed_file(path: str, _mtime_ns: int, _size: int) -> PlanFile:
    """A plan file read once while it stays unchanged (the key holds its mtime and size)."""
    return read_plan_file(path)


def _plan_of(args: dict[str, Any]) -> tuple[PlanFile, str] | None:
    """The plan ``args`` name and where it is; None where it cannot be read (see __init__)."""
    try:
        if isinstance(args.get("plan_text"), str):
            return _parsed_text(args["plan_text"]), "<plan_text>"
        path = args.get("solution_path")
        if isinstance(path, str):
            found = os.stat(path)
            return _parsed_file(path, found.st_mtime_ns, found.st_size), path
    except (ConfigError, OSError):
        pass
    return None


class PointSolution(FrequencyScheduler):
    """Runs one frequency plan for the whole job.

    The plan is read and checked against the job when the scheduler is built, so a bad file
    fails the job at registration rather than mid-training.

    Args:
        job_info: The training job.
        rank_infos: Every rank of the job, in any order.
        solution_path: A plan file (``freqs_pipeline_%05d.py``) with one stage list per rank.
        plan_text: The plan file's text instead of its path: the plan then travels with the
            job in Redis, so workers need no shared filesystem. Give exactly one of the two.

    Raises:
        ConfigError: The file is malformed, has the wrong number of stage lists, or uses a
            frequency some rank's GPU does not support.

    """

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: list[RankInfo],
        solution_path: str | None = None,
        plan_text: str | None = None,
    ) -> None:
        super().__init__(job_info, rank_infos)
        self.check_args({"solution_path": solution_path, "plan_text": plan_text})
        self.solution_path = solution_path
        if plan_text is not None:
            self.plan: PlanFile = parse_plan_text(plan_text, source="<plan_text>")
        else:
            assert solution_path is not None
            self.plan = read_plan_file(solution_path)
        # The plan's i-th line is rank i's (Zeus's convention for pure pipeline jobs).
        check_plan_fits(
            self.plan,
            job_info,
            check_rank_infos(job_info, rank_infos),
            stage_of=lambda info: info.rank,
            name=type(self).__name__,
            real_job=getattr(self, "real_job_info", None),  # Set by the 3D wrapper.
        )

    server_path_args = frozenset({"solution_path"})

    @classmethod
    def check_args(cls, args: dict[str, Any]) -> None:
        """Exactly one of ``solution_path`` and ``plan_text`` must be given; the text parses.

        Checked when the job registers: a plan text that does not parse failed the job only
        once its ranks had registered, at the first version.
        """
        given = [k for k in ("solution_path", "plan_text") if args.get(k) is not None]
        if len(given) != 1:
            raise ConfigError(
                f"{cls.__name__} needs exactly one of solution_path (a plan file) or plan_text "
                f"(its text); got {given or 'neither'}"
            )
        if isinstance(args.get("plan_text"), str):
            parse_plan_text(args["plan_text"], source="<plan_text>")

    @classmethod
    def check_rank(cls, args: dict[str, Any], rank: RankInfo) -> None:
        """Every clock of the rank's plan line must be its GPU's.

        Found by the constructor only, the job failed at its first schedule, after every
        rank had registered. A rank runs line ``rank`` (the 3D variant: line ``pp_rank``);
        a plan without that line is left to the constructor, which names the counts.
        """
        found = _plan_of(args)
        line = rank.pp_rank if is_3d_parallel(cls) else rank.rank
        if found is None or line >= found[0].num_stages:
            return
        plan, where = found
        available = set(rank.available_frequencies)
        for i, (inst, freq) in enumerate(plan.stages[line]):
            if freq not in available:
                raise ProtocolError(
                    f"rank {rank.rank} (stage {line}): {where}, instruction {i} ({inst}): "
                    f"frequency {freq} MHz is not among the rank's available frequencies "
                    f"({max(available)}..{min(available)} MHz, {len(available)} values)"
                )

    @classmethod
    def check_files(cls, args: dict[str, Any]) -> None:
        """The plan file must exist and parse."""
        if args.get("solution_path") is not None:
            read_plan_file(args["solution_path"])

    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        """Yield the plan once; the base class then serves it forever."""
        yield [
            FrequencySchedule(rank=rank, frequencies=list(stage))
            for rank, stage in enumerate(self.plan.stages)
        ]


PointSolution3D = make_3d_parallel(PointSolution)
