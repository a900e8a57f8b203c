"""Store writes queued on one pipeline, so that a batch of stream entries costs one round trip."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from protocol import keys
from protocol.exceptions import ProtocolError, UnknownJobError
from protocol.job_record import unknown_job
from protocol.models import JobConfig, JobInfo, ProfilingResult, RankInfo, SetTarget, pack

if TYPE_CHECKING:
    from protocol.store import JobStore


class StoreBatch:
    """Store writes queued on one pipeline: many entries, one round trip.

    Each method queues one atomic write; :meth:`execute` returns, in order, each write's
    outcome (what the same :class:`JobStore` method returns) or the PerseusError it raised.
    """

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.pipe = store.conn.pipeline(transaction=False)
        self._finish: list[Callable[[Any], Any]] = []

    def __len__(self) -> int:
        return len(self._finish)

    def create_job(self, job: JobInfo, config: JobConfig, entry_id: str, now: float) -> None:
        """Queue :meth:`JobStore.create_job`."""
        fields: dict[str, str] = {
            "job_id": job.job_id,
            "pp_degree": str(job.pp_degree),
            "dp_degree": str(job.dp_degree),
            "tp_degree": str(job.tp_degree),
            "world_size": str(job.world_size),
            "job_metadata": job.job_metadata or "",
            "scheduler": config.scheduler,
            "scheduler_args": json.dumps(config.scheduler_args, sort_keys=True),
            "dump_dir": config.dump_dir,
            "created_at": f"{now:.3f}",
            "entry_id": entry_id,
            "error": "",
            # Bookkeeping the DUE script reads (see JobState.due).
            "complete": "0",
            "tail_observed": "",
            "tail_controls": "0",
            "snapshot_len": "0",
            "results_floor": "1",
        }
        flat = [x for pair in fields.items() for x in pair]
        self.store._create(
            keys=[keys.job_info(job.job_id), keys.JOBS_INDEX],
            args=[job.job_id, now, entry_id, *flat],
            client=self.pipe,
        )

        def finish(reply: Any) -> bool:
            created, owner = reply
            if not created and owner.decode() != entry_id:
                raise ProtocolError(
                    f"job id {job.job_id} is already used by registration {owner.decode()}"
                )
            return bool(created)

        self._finish.append(finish)

    def add_rank(self, job: JobInfo, rank: RankInfo, now: float) -> None:
        """Queue :meth:`JobStore.add_rank` (its fit to the job is checked now)."""
        try:
            rank.check_fits(job)
        except ValueError as exc:
            self._fail(ProtocolError(str(exc)))
            return
        self.store._add_rank(
            keys=[
                keys.job_info(job.job_id),
                keys.job_ranks(job.job_id),
                keys.JOBS_INDEX,
                keys.DUE_JOBS,
            ],
            args=[job.job_id, now, rank.rank, pack(rank), job.world_size],
            client=self.pipe,
        )

        def finish(reply: Any) -> int:
            status, count = reply
            if status == -1:
                raise unknown_job(job.job_id)
            if status == -2:
                raise ProtocolError(
                    f"rank {rank.rank} of job {job.job_id} is already registered with other info"
                )
            return int(count)

        self._finish.append(finish)

    def add_result(self, job: JobInfo, result: ProfilingResult, now: float) -> None:
        """Queue :meth:`JobStore.add_result`."""
        if result.rank >= job.world_size:
            self._fail(ProtocolError(f"rank {result.rank} is out of range for job {job.job_id}"))
            return
        version = result.schedule_version
        self.store._add_result(
            keys=[
                keys.job_info(job.job_id),
                keys.job_ranks(job.job_id),
                keys.job_version(job.job_id),
                keys.job_results(job.job_id, version),
                keys.JOBS_INDEX,
                keys.DUE_JOBS,
            ],
            args=[job.job_id, now, result.rank, pack(result), version, job.world_size],
            client=self.pipe,
        )

        def finish(reply: Any) -> tuple[bool, int, int]:
            added, latest, count = (int(x) for x in reply)
            if added == -1:
                raise unknown_job(job.job_id)
            if added == -3:
                raise ProtocolError(f"rank {result.rank} is not registered with job {job.job_id}")
            if added == -4:
                raise ProtocolError(
                    f"result for schedule version {version} of job {job.job_id}, but the "
                    f"latest published version is {latest}"
                )
            # -5: a late result of a version the scheduler has consumed: nothing to do.
            return added == 1, latest, count

        self._finish.append(finish)

    def add_control(self, message: SetTarget, entry_id: str, now: float) -> None:
        """Queue :meth:`JobStore.add_control`."""
        job_id = message.job_id
        self.store._add_control(
            keys=[keys.job_info(job_id), keys.job_control(job_id), keys.JOBS_INDEX, keys.DUE_JOBS],
            args=[entry_id, pack(message), job_id, now],
            client=self.pipe,
        )

        def finish(reply: Any) -> bool:
            if int(reply) == -1:
                raise unknown_job(job_id)
            return int(reply) == 1

        self._finish.append(finish)

    def _fail(self, error: Exception) -> None:
        def finish(_reply: Any) -> Any:
            raise error

        self._finish.append(finish)
        self.pipe.echo(b"")  # keeps replies aligned with queued writes

    def execute(self) -> list[Any]:
        """Send every queued write; return each outcome, or the PerseusError it raised.

        Raises:
            redis.RedisError: Redis failed (nothing is known about which writes happened;
                every write is idempotent, so the caller retries them all).
        """
        if not self._finish:
            return []
        replies = self.pipe.execute(raise_on_error=False)
        outcomes: list[Any] = []
        for finish, reply in zip(self._finish, replies, strict=True):
            if isinstance(reply, redis.RedisError):
                raise reply
            try:
                outcomes.append(finish(reply))
            except (ProtocolError, UnknownJobError) as exc:
                outcomes.append(exc)
        self._finish = []
        return outcomes


def single(batch: StoreBatch) -> Any:
    """Execute a batch of one write; return its outcome or raise its error."""
    (outcome,) = batch.execute()
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
