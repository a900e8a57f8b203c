"""What a registering job or rank gets: scheduler and arguments, within the coordinator's limits."""

from __future__ import annotations

from coordinator.settings import PerseusSettings
from protocol.exceptions import ConfigError, ProtocolError
from protocol.models import JobConfig, JobInfo, RankInfo, RegisterJob
from protocol.scheduler import (
    BUILTIN,
    FrequencyScheduler,
    check_scheduler_args,
    resolve_scheduler,
)
from protocol.suggest import did_you_mean


def job_config(settings: PerseusSettings, message: RegisterJob) -> JobConfig:
    """The scheduler, arguments and dump folder a registering job gets, checked for the job.

    A job may name a built-in scheduler and send data arguments; a ``module:Class`` scheduler
    and arguments that name server paths come from the coordinator's settings only.

    Raises:
        ProtocolError: The job asks for what a client may not choose (the reason says what).
        ConfigError: Its scheduler does not accept its arguments, or not for a job of its
            degrees (:meth:`~protocol.scheduler.FrequencyScheduler.check_job`).
    """
    config = _chosen(settings, message)
    scheduler = resolve_scheduler(config.scheduler)
    try:
        scheduler.check_job(config.scheduler_args, message.job)
    except ConfigError as exc:
        which = "its" if message.scheduler is not None else "the coordinator's"
        raise ConfigError(f"{exc} ({which} scheduler_args)") from None
    return config


def _chosen(settings: PerseusSettings, message: RegisterJob) -> JobConfig:
    """The scheduler and arguments the job gets, checked, before its degrees are."""
    dump_dir = settings.dump_dir if settings.dump_data else ""
    if message.scheduler is None:
        # Arguments go with the scheduler a job names: without one they were dropped unsaid
        # and the job ran the coordinator's scheduler with the coordinator's arguments.
        sent = sorted(k for k, v in message.scheduler_args.items() if v is not None)
        if sent:
            raise ProtocolError(
                f"scheduler_args {sent} sent without a scheduler: a job's arguments go with "
                "the scheduler it names (PerseusOptimizer's scheduler=); the coordinator's "
                "default scheduler takes the coordinator's arguments (PERSEUS_SCHEDULER_ARGS)"
            )
        if not settings.scheduler:
            raise ProtocolError(
                "this coordinator has no default scheduler (PERSEUS_SCHEDULER is empty): "
                "the job must choose one when it registers (PerseusOptimizer's scheduler= "
                f"and scheduler_args=: one of {', '.join(sorted(BUILTIN))}; `perseus "
                "schedulers` lists their arguments), or start the coordinator with "
                "--scheduler NAME --scheduler-args JSON for jobs that name none"
            )
        return JobConfig(
            scheduler=settings.scheduler,
            scheduler_args=settings.scheduler_args,
            dump_dir=dump_dir,
        )
    # A job may pick a built-in scheduler only: a `module:Class` sent by a client would let
    # any rank make the workers import arbitrary code.
    if message.scheduler not in BUILTIN:
        raise ProtocolError(
            f"job asked for scheduler {message.scheduler!r}"
            f"{did_you_mean(message.scheduler, BUILTIN)}; a job may choose one of "
            f"{', '.join(sorted(BUILTIN))} (others only through the coordinator's settings)"
        )
    given = {k for k, v in message.scheduler_args.items() if v is not None}
    paths = sorted(resolve_scheduler(message.scheduler).server_path_args & given)
    if paths:
        raise ProtocolError(
            f"scheduler argument(s) {', '.join(paths)} of {message.scheduler} name paths on "
            "the server; only the coordinator's settings may set them (a job may send "
            "data: plan_text, policies, numbers)"
        )
    check_scheduler_args(message.scheduler, message.scheduler_args)
    return JobConfig(
        scheduler=message.scheduler, scheduler_args=message.scheduler_args, dump_dir=dump_dir
    )


def check_job_limits(settings: PerseusSettings, job: JobInfo) -> None:
    """Refuse a job registration the coordinator's limits do not allow.

    Raises:
        ProtocolError: The job sets its own id, or its world size is over the limit.
    """
    if job.job_id:
        raise ProtocolError("job_id must be empty when registering a job; the coordinator sets it")
    if job.world_size > settings.max_world_size:
        raise ProtocolError(
            f"world_size {job.world_size} is over max_world_size="
            f"{settings.max_world_size} (PERSEUS_MAX_WORLD_SIZE)"
        )


def check_rank_limits(
    settings: PerseusSettings, config: JobConfig, rank: RankInfo
) -> type[FrequencyScheduler]:
    """Refuse a rank whose clocks are over the limits; return the job's scheduler class.

    Raises:
        ProtocolError: Too many clocks, a profiling sweep over ``max_sweep_versions``, or
            clocks the job's scheduler arguments ask for that the rank's GPU lacks.
    """
    clocks = len(rank.available_frequencies)
    if clocks > settings.max_frequencies:
        raise ProtocolError(
            f"rank {rank.rank} registers {clocks} frequencies, over "
            f"max_frequencies={settings.max_frequencies} (PERSEUS_MAX_FREQUENCIES)"
        )
    scheduler = resolve_scheduler(config.scheduler)
    sweep = scheduler.sweep_versions(config.scheduler_args, clocks)
    if sweep is not None and sweep > settings.max_sweep_versions:
        raise ProtocolError(
            f"rank {rank.rank} registers {clocks} frequencies: the {config.scheduler} sweep "
            f"would take {sweep} versions, over max_sweep_versions="
            f"{settings.max_sweep_versions} (PERSEUS_MAX_SWEEP_VERSIONS); restrict its "
            "frequencies"
        )
    scheduler.check_rank(config.scheduler_args, rank)
    return scheduler
