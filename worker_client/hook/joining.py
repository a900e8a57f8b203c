"""How a rank joins its job (rank 0 registers it for all, then each rank itself), and leaves it."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import redis
import torch.distributed as dist

from protocol.codec import validate
from protocol.exceptions import ConfigError, PerseusError
from protocol.job_lifecycle import JobLifecycle
from protocol.models import JobInfo, RankInfo
from worker_client.gpu.frequency import make_controller
from worker_client.gpu.nvml import NVML
from worker_client.hook.clock_requests import FrequencySetter
from worker_client.hook.session import CoordinatorClient

logger = logging.getLogger(__name__)

#: Seconds a rank waits for the others' hooks before it says what it waits for.
JOIN_WARNING_S = 30.0
#: Seconds :func:`finish_rank` waits for Redis to record the rank finished.
FINISH_TIMEOUT_S = 5.0


#: What a rank waits for in the join's first agreement, for :func:`_said_if_slow`.
WAITING_FOR_HOOKS = (
    "the other ranks to create their hook (PerseusOptimizer or PerseusPipeline): every rank "
    "of the job must create one"
)


@contextlib.contextmanager
def _said_if_slow(
    rank: int, seconds: float, waiting_for: str = WAITING_FOR_HOOKS
) -> Iterator[None]:
    """Log, once, a rank that waits on the other ranks longer than ``seconds``.

    A rank whose script never creates its hook leaves every other rank in a collective that
    says nothing (gloo and NCCL wait for 30 minutes by default).
    """
    timer = threading.Timer(
        seconds,
        logger.warning,
        ("rank %d: still waiting after %.0f s for %s", rank, seconds, waiting_for),
    )
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def agree(rank: int, local_error: Exception | None, what: str, waiting_for: str) -> None:
    """Every rank tells the others whether it failed; each raises if any rank did.

    A collective (one ``all_gather_object`` on the default group) that every rank calls at
    the same point: a rank that raised alone would leave the others waiting in the job's next
    collective until the process group's timeout (30 minutes by default), or failing there
    with gloo's "Connection closed by peer" that says nothing of why.

    Args:
        rank: This rank, for the message of a slow wait.
        local_error: What stopped this rank, if anything.
        what: What failed, for the others' message (``"no job registered"``).
        waiting_for: What a rank still waiting after ``JOIN_WARNING_S`` logs it waits for.

    Raises:
        Exception: ``local_error`` itself, on its rank.
        PerseusError: Another rank failed: ``what``, then each failed rank and its error.
    """
    reasons: list[Any] = [None] * dist.get_world_size()
    mine = f"{type(local_error).__name__}: {local_error}" if local_error is not None else None
    with _said_if_slow(rank, JOIN_WARNING_S, waiting_for):
        dist.all_gather_object(reasons, mine)
    if local_error is not None:
        raise local_error
    failed = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why is not None]
    if failed:
        raise PerseusError(f"{what}; {'; '.join(failed)}")


def refuse_to_join(rank: int, error: Exception) -> NoReturn:
    """Raise ``error`` on a rank that fails before it creates its hook, and on every other rank.

    Joins the first collective of the other ranks' hooks (:func:`agree_on_job`'s), so that
    they raise "no job registered; rank N: ..." at once instead of waiting there.
    """
    if not dist.is_initialized():
        raise error  # no group: no other rank can be waiting
    agree(rank, error, "no job registered", WAITING_FOR_HOOKS)
    raise AssertionError("agree() raises the error it is given")  # pragma: no cover


@dataclass
class RankGPU:
    """The GPU a rank drives, opened before the rank joins its job."""

    nvml: NVML
    index: int  # NVML's index (device_id is CUDA's)
    clocks: list[int]
    controller: FrequencySetter
    owns_controller: bool

    @classmethod
    def open(cls, nvml_module: str, device_id: int, controller: FrequencySetter | str) -> RankGPU:
        """Open NVML, find CUDA device ``device_id``'s NVML index and clocks, make the controller.

        Raises:
            GPUError: NVML cannot be opened or read, or the controller cannot start.
            ConfigError: ``device_id`` is not a visible CUDA device.
        """
        nvml = NVML(nvml_module)
        index = nvml.cuda_to_nvml(device_id)
        clocks = nvml.graphics_clocks(index)
        owns = isinstance(controller, str)
        if isinstance(controller, str):
            controller = make_controller(controller, index, nvml_module=nvml_module)  # type: ignore[arg-type]
        return cls(nvml, index, clocks, controller, owns)

    def rank_info(self, rank: int, dp_rank: int, pp_rank: int, tp_rank: int) -> RankInfo:
        """What the rank registers: its coordinates and this GPU's clocks."""
        return RankInfo(
            rank=rank,
            dp_rank=dp_rank,
            pp_rank=pp_rank,
            tp_rank=tp_rank,
            available_frequencies=self.clocks,
        )

    def close(self) -> None:
        """Stop a controller this made (the rank is not joining after all)."""
        if self.owns_controller:
            self.controller.stop()


def group_mismatch(rank: int, world_size: int) -> ConfigError | None:
    """Why ``rank`` and ``world_size`` do not fit torch.distributed's default group, if they do not.

    Rank 0 of the group registers the job and every rank of the group joins the collectives
    below, so the hook's ``rank`` must be the group's rank and ``world_size`` its size: a
    local rank given as ``rank`` left no rank 0 to register, and a ``world_size`` larger than
    the group left the job waiting for ranks that never come.
    """
    if rank != dist.get_rank():
        return ConfigError(
            f"rank={rank} but this process is rank {dist.get_rank()} of torch.distributed's "
            "default group: pass the global rank (dist.get_rank()), not a local one"
        )
    if world_size != dist.get_world_size():
        return ConfigError(
            f"world_size={world_size} but torch.distributed's default group has "
            f"{dist.get_world_size()} rank(s): every rank of the group takes part in the job"
        )
    return None


def agree_on_job(
    client: CoordinatorClient | None,
    rank: int,
    *,
    dp_degree: int,
    pp_degree: int,
    tp_degree: int,
    world_size: int,
    job_metadata: str | None,
    scheduler: str | None,
    scheduler_args: dict[str, Any] | None,
    local_error: Exception | None = None,
) -> str:
    """Rank 0 registers the job and broadcasts its id (or its error) to every rank.

    Every rank calls this (it is a collective). Rank 0's failure, a bad ``JobInfo`` field
    included, reaches every rank as the same error instead of leaving the others waiting in
    the broadcast. So does a rank's ``local_error`` (it could not open its GPU, say), and
    then no job is registered.

    Args:
        client: This rank's coordinator client (None only with a ``local_error``: making
            it failed, say).
        rank: Global rank.
        dp_degree: Data parallel degree.
        pp_degree: Pipeline parallel degree.
        tp_degree: Tensor parallel degree.
        world_size: Number of ranks.
        job_metadata: Optional tag appended to the job id.
        scheduler: A built-in scheduler for this job instead of the coordinator's default.
        scheduler_args: Arguments of ``scheduler``.
        local_error: What stops this rank from training, if anything; ``rank`` or
            ``world_size`` that do not fit torch.distributed's default group stop it too.

    Returns:
        The job id.

    Raises:
        Exception: ``local_error`` itself, on its rank.
        ConfigError: ``rank`` or ``world_size`` do not fit torch.distributed's default group.
        PerseusError: Another rank had a ``local_error``, or rank 0 could not register the
            job (the message says which and why).
    """
    if local_error is None:
        local_error = group_mismatch(rank, world_size)
    agree(rank, local_error, "no job registered", WAITING_FOR_HOOKS)
    job_id: str | None = None
    error: str | None = None
    if rank == 0:
        try:
            assert client is not None  # None only with a local_error, raised above
            # Errors name the field in one line (not pydantic's several, with a web link).
            info = validate(
                JobInfo,
                {
                    "dp_degree": dp_degree,
                    "pp_degree": pp_degree,
                    "tp_degree": tp_degree,
                    "world_size": world_size,
                    "job_metadata": job_metadata,
                },
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


def finish_rank(client: CoordinatorClient, job_id: str, rank: int, reachable: bool) -> None:
    """Record in Redis that ``rank`` is done; once every rank is, the job is finished.

    Idempotent (a set of ranks). Never raises: closing must not fail training's last step.
    Skipped while Redis is unreachable, and given up after ``FINISH_TIMEOUT_S`` without a
    reply (close does not wait on Redis): the job is then deleted when idle instead.

    Args:
        client: The hook's client (its token for the rank proves the rank's identity).
        job_id: The job.
        rank: The rank.
        reachable: Whether the hook's threads last reached Redis (and sent every result).
    """
    if not reachable:
        logger.warning(
            "rank %d: redis unreachable at close; job %s not marked finished", rank, job_id
        )
        return
    # Over a client that waits FINISH_TIMEOUT_S for a reply, not the registrations' long
    # socket time-out with redis-py's retries: on a silent network, minutes.
    finisher = client.background_client(socket_timeout=FINISH_TIMEOUT_S)
    try:
        token = client.token(job_id, rank) or ""
        done = JobLifecycle(finisher.store).finish_rank(job_id, rank, token)
    except (redis.RedisError, PerseusError, ValueError) as exc:
        logger.warning(
            "rank %d: could not mark job %s finished (%s); it is deleted when idle instead",
            rank,
            job_id,
            exc,
        )
        return
    finally:
        finisher.close()
    if done:
        logger.info("job %s: every rank finished", job_id)
