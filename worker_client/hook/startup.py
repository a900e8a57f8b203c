"""A rank's start: register the job, join it, get the first schedule, agreeing at each step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol.models import FrequencySchedule
from worker_client.hook.energy_source import EnergySource, default_energy_source
from worker_client.hook.joining import RankGPU, agree, agree_on_job, join_job
from worker_client.hook.session import CoordinatorClient

#: What a rank that joined waits for in the join's later agreements (see joining.agree).
_OTHER_RANKS_JOIN = "the other ranks to register with the job and get their first schedule"


@dataclass
class StartedRank:
    """What a rank holds once every rank of the job joined and got its first schedule.

    Attributes:
        client: Its coordinator client.
        gpu: Its GPU (NVML and frequency controller).
        job_id: The job every rank joined.
        instruction_energy: Whether it measures per-instruction energy.
        energy_source: Where its energy marks come from.
        owns_source: Whether ``energy_source`` was made here (and is closed with the hook).
        schedule: Its first schedule.
    """

    client: CoordinatorClient
    gpu: RankGPU
    job_id: str
    instruction_energy: bool
    energy_source: EnergySource
    owns_source: bool
    schedule: FrequencySchedule


def start_rank(
    rank: int,
    coordinates: tuple[int, int, int],
    job: dict[str, Any],
    client: CoordinatorClient | None,
    gpu: RankGPU | None,
    failure: Exception | None,
    instruction_energy: bool | None,
    energy_source: EnergySource | None,
    schedule_timeout: float,
) -> StartedRank:
    """Register (rank 0), join and wait for the first schedule, agreeing with every rank.

    What fails on one rank only (its arguments, its Redis URL, its GPU, the coordinator
    refusing it, a schedule that never comes) fails every rank in the next agreement, where
    the others would otherwise wait for it in a collective it never joins. On any failure
    what this call holds (GPU, energy source, client) is closed.

    Args:
        rank: Global rank.
        coordinates: ``(dp_rank, pp_rank, tp_rank)``.
        job: :func:`~worker_client.hook.joining.agree_on_job` keywords: degrees, world size,
            metadata, scheduler and its arguments.
        client: This rank's client (None: making it failed, see ``failure``).
        gpu: This rank's GPU (None: opening it failed, see ``failure``).
        failure: What already failed on this rank, or None.
        instruction_energy: Per-instruction energy (None: as the job's scheduler needs).
        energy_source: The caller's energy source (None: the GPU's default one, made here).
        schedule_timeout: Seconds to wait for the first schedule.

    Raises:
        PerseusError: This rank's failure, or another rank's, named.
    """
    owned: EnergySource | None = None
    try:
        job_id = agree_on_job(client, rank, local_error=failure, **job)
        assert client is not None and gpu is not None  # or agree_on_job raised
        failure = None
        try:
            joined = gpu.rank_info(rank, *coordinates)
            # Unset: measure per-instruction energy exactly when the scheduler needs it.
            instruction_energy = join_job(client, job_id, joined, instruction_energy)
            if energy_source is None:
                energy_source = owned = default_energy_source(gpu.nvml, gpu.index)
        except Exception as exc:
            failure = exc
        agree(rank, failure, f"job {job_id}: not every rank joined", _OTHER_RANKS_JOIN)
        assert energy_source is not None and instruction_energy is not None  # or agree raised
        try:
            schedule = client.wait_schedule(job_id, rank, 0, schedule_timeout)
        except Exception as exc:
            failure = exc
        agree(rank, failure, f"job {job_id}: not every rank got its schedule", _OTHER_RANKS_JOIN)
    except BaseException:
        # A rank that failed to start leaves no controller process, sampler or connection.
        if gpu is not None:
            gpu.close()
        if owned is not None and hasattr(owned, "close"):
            owned.close()
        if client is not None:
            client.close()
        raise
    return StartedRank(
        client, gpu, job_id, instruction_energy, energy_source, owned is not None, schedule
    )
