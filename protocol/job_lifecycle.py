"""A job's end: ranks that finished, finished jobs, and jobs that never started.

A rank's hook marks its rank finished when it closes; when every rank has, the job is
finished (``perseus:jobs:finished``, timed by the Redis server's clock) and the coordinator's
sweep deletes it after ``finished_retention``. A job that never got its first schedule version
(a rank failed before registering, its scheduler failed at once) waits in
``perseus:jobs:starting`` and is deleted after ``start_retention`` without activity, rather
than after the week of ``max_job_idle_time``. Both sets are sorted by time, so a sweep reads
only the jobs due for deletion, however many jobs have finished.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import redis

from protocol import keys
from protocol.exceptions import WrongTokenError
from protocol.rank_functions import FINISH_FUNCTION, RankScript
from protocol.store import JobStore
from protocol.store_scripts import FINISH
from protocol.tokens import alive_proof, proof_marks, result_key


@dataclass(frozen=True)
class Ending:
    """Where a job stands at its end: finish time (server clock) and ranks finished."""

    finished_at: float | None
    ranks_finished: int

    @property
    def finished(self) -> bool:
        """Whether every rank finished (or an operator finished the job)."""
        return self.finished_at is not None


class JobLifecycle:
    """Finish ranks and jobs, and find the jobs the sweep deletes.

    Args:
        store: The job store (its connection and clock).
    """

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._finish = RankScript(store.conn, FINISH_FUNCTION, FINISH)

    def _call(self, job_id: str, rank: str, token: str = "") -> tuple[int, int, int]:
        names = [keys.job_finished(job_id), keys.FINISHED_JOBS]
        proof = alive_proof(result_key(token)) if rank else ""
        args = [job_id, rank, token, proof, keys.job_info(job_id), keys.job_beatcheck(job_id)]
        status, count, world = self._finish(keys=names, args=args)
        return int(status), int(count), int(world)

    def finish_rank(self, job_id: str, rank: int, token: str) -> bool | None:
        """Mark ``rank`` finished; return whether the job is now finished (None: no such job).

        Args:
            job_id: The job.
            rank: The rank that finished.
            token: The token ``rank`` got when it registered.

        Raises:
            ValueError: ``rank`` is not one of the job's ranks.
            WrongTokenError: ``token`` is not ``rank``'s (nothing is recorded).
        """
        status, _count, world = self._call(job_id, str(int(rank)), token)
        if status == -1:
            raise ValueError(f"rank {rank} is out of range for job {job_id} (world size {world})")
        if status == -2:
            raise WrongTokenError(f"wrong token for rank {rank} of job {job_id}: finish refused")
        return None if status == 0 else status == 2

    def finish_job(self, job_id: str) -> bool:
        """Mark the job finished whatever its ranks did; False if there is no such job."""
        return self._call(job_id, "")[0] == 2

    def endings(self, job_ids: Iterable[str]) -> dict[str, Ending]:
        """Finish time and ranks finished of each job (one round trip)."""
        ids = list(job_ids)
        with self.store.conn.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.zscore(keys.FINISHED_JOBS, job_id)
                pipe.scard(keys.job_finished(job_id))
            replies = pipe.execute()
        return {
            job_id: Ending(None if at is None else float(at), int(count))
            for job_id, at, count in zip(ids, replies[::2], replies[1::2], strict=True)
        }

    def finish_proven(self, job_id: str) -> bool:
        """Whether the job's finish holds: an operator's, or one proven by each of its ranks.

        The finished sets are writable by every rank (ACL patterns cannot tell jobs apart):
        the sweep asks this before deleting a finished job.
        """
        conn = self.store.conn
        by, world = conn.hmget(keys.job_info(job_id), ["finished_by", "world_size"])
        if by == b"operator":
            return True
        marks = list(proof_marks(conn.hgetall(keys.job_tokens(job_id))).values())
        if world is None or len(marks) < int(world):
            return False
        try:
            found = conn.smismember(keys.job_finished(job_id), marks)
        except redis.ResponseError:  # WRONGTYPE: a rank replaced the set
            return False
        return sum(found) >= int(world)

    def finished_ranks(self, job_id: str) -> list[int]:
        """Ranks whose finish is proven (what another rank wrote into the set does not count)."""
        conn = self.store.conn
        marks = proof_marks(conn.hgetall(keys.job_tokens(job_id)))
        if not marks:
            return []
        try:
            found = conn.smismember(keys.job_finished(job_id), list(marks.values()))
        except redis.ResponseError:  # WRONGTYPE: a rank replaced the set
            return []
        return sorted(rank for rank, hit in zip(marks, found, strict=True) if hit)

    def finished_before(self, cutoff: float, limit: int) -> list[str]:
        """Jobs finished before server time ``cutoff`` (the ``limit`` oldest)."""
        rows = self.store.conn.zrangebyscore(keys.FINISHED_JOBS, "-inf", cutoff, 0, limit)
        return [job_id.decode() for job_id in rows]

    def starting_before(self, cutoff: float, limit: int) -> list[str]:
        """Jobs registered before ``cutoff`` that had no schedule version when last checked."""
        rows = self.store.conn.zrangebyscore(keys.STARTING_JOBS, "-inf", cutoff, 0, limit)
        return [job_id.decode() for job_id in rows]

    def collect_unstarted(self, job_id: str, idle_before: float) -> bool:
        """Delete a job that never got a schedule version and is idle since ``idle_before``.

        A job that has a version leaves the starting set; one still active is checked again
        ``start_retention`` after its last activity. Returns whether it was deleted.
        """
        conn = self.store.conn
        if self.store.version(job_id) > 0:
            conn.zrem(keys.STARTING_JOBS, job_id)
            return False
        # delete_job checks the activity atomically: a version published or a rank registered
        # since the check above refreshed it, and the job stays.
        if self.store.delete_job(job_id, idle_before=idle_before):
            return True
        last = conn.zscore(keys.JOBS_INDEX, job_id)
        if last is None:  # Deleted meanwhile by someone else: nothing left to watch.
            conn.zrem(keys.STARTING_JOBS, job_id)
        else:
            conn.zadd(keys.STARTING_JOBS, {job_id: float(last)}, xx=True)
        return False
