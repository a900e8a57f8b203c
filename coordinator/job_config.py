"""What a registering job gets: scheduler and arguments, within what a client may choose."""

from __future__ import annotations

from coordinator.settings import PerseusSettings
from protocol.exceptions import ProtocolError
from protocol.models import JobConfig, RegisterJob
from protocol.scheduler import BUILTIN, check_scheduler_args, resolve_scheduler


def job_config(settings: PerseusSettings, message: RegisterJob) -> JobConfig:
    """The scheduler, arguments and dump folder a registering job gets.

    A job may name a built-in scheduler and send data arguments; a ``module:Class`` scheduler
    and arguments that name server paths come from the coordinator's settings only.

    Raises:
        ProtocolError: The job asks for what a client may not choose (the reason says what).
        ConfigError: Its scheduler does not accept its arguments.
    """
    dump_dir = settings.dump_dir if settings.dump_data else ""
    if message.scheduler is None:
        if not settings.scheduler:
            raise ProtocolError(
                "this coordinator has no default scheduler (PERSEUS_SCHEDULER is empty): "
                "the job must choose one when it registers"
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
            f"job asked for scheduler {message.scheduler!r}; a job may choose one of "
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
