"""How a rank joins its job: rank 0 registers the job for every rank, then each rank registers."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from protocol.exceptions import ConfigError, PerseusError
from protocol.models import JobInfo, RankInfo
from worker_client.hook.session import CoordinatorClient


def agree_on_job(
    client: CoordinatorClient,
    rank: int,
    *,
    dp_degree: int,
    pp_degree: int,
    tp_degree: int,
    world_size: int,
    job_metadata: str | None,
    scheduler: str | None,
    scheduler_args: dict[str, Any] | None,
) -> str:
    """Rank 0 registers the job and broadcasts its id (or its error) to every rank.

    Every rank calls this (it is a collective). Rank 0's failure, a bad ``JobInfo`` field
    included, reaches every rank as the same error instead of leaving the others waiting in
    the broadcast.

    Args:
        client: This rank's coordinator client.
        rank: Global rank.
        dp_degree: Data parallel degree.
        pp_degree: Pipeline parallel degree.
        tp_degree: Tensor parallel degree.
        world_size: Number of ranks.
        job_metadata: Optional tag appended to the job id.
        scheduler: A built-in scheduler for this job instead of the coordinator's default.
        scheduler_args: Arguments of ``scheduler``.

    Returns:
        The job id.

    Raises:
        PerseusError: Rank 0 could not register the job (the message says why).
    """
    job_id: str | None = None
    error: str | None = None
    if rank == 0:
        try:
            info = JobInfo(
                dp_degree=dp_degree,
                pp_degree=pp_degree,
                tp_degree=tp_degree,
                world_size=world_size,
                job_metadata=job_metadata,
            )
            job_id = client.register_job(info, scheduler, scheduler_args)
        except Exception as exc:  # whatever it is, the other ranks must hear of it
            error = f"{type(exc).__name__}: {exc}"
    box: list[Any] = [(job_id, error)]
    dist.broadcast_object_list(box, src=0)
    job_id, error = box[0]
    if error is not None or job_id is None:
        raise PerseusError(f"rank 0 could not register the job: {error}")
    return job_id


def join_job(
    client: CoordinatorClient, job_id: str, rank_info: RankInfo, instruction_energy: bool | None
) -> bool:
    """Register this rank with its job; return whether it measures per-instruction energy.

    Args:
        client: This rank's coordinator client.
        job_id: The job (from :func:`agree_on_job`).
        rank_info: This rank's coordinates and its GPU's clocks.
        instruction_energy: The hook's setting: ``None`` measures per-instruction energy
            exactly when the job's scheduler needs it.

    Raises:
        ConfigError: The scheduler needs per-instruction energy and ``instruction_energy`` is
            False.

    Returns:
        Whether this rank measures per-instruction energy.
    """
    reply = client.register_rank(job_id, rank_info)
    if instruction_energy is False and reply.instruction_energy:
        raise ConfigError(
            f"job {job_id}: its scheduler needs per-instruction energy; leave "
            "instruction_energy unset (or True) to measure it"
        )
    return bool(reply.instruction_energy or instruction_energy)
