"""Checks that a result comes from the process that registered its rank (per-rank tokens).

Each result entry carries an HMAC of its data under a key derived from its rank's token
(:mod:`protocol.tokens`). The coordinator keeps the keys it has used: a rank registers once
per job, so its key never changes, and a burst of results costs no extra round trip.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from protocol.exceptions import ProtocolError, UnknownJobError, WrongTokenError
from protocol.models import ReportResult
from protocol.store import JobStore
from protocol.tokens import verify

_JOBS_CACHED = 10_000  # jobs whose ranks' keys a coordinator keeps (64 hex per rank)


class ResultKeys:
    """The results' HMAC keys of registered ranks, cached per job.

    Args:
        store: Where the keys are read (``perseus:job:<id>:tokens``).
    """

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._jobs: OrderedDict[str, dict[int, str]] = OrderedDict()
        self._gone: set[str] = set()  # jobs of the current batch that Redis does not have

    def load(self, wanted: Collection[tuple[str, int]]) -> None:
        """Fetch the keys of the (job, rank) pairs not cached yet, in one round trip."""
        self._gone = set()
        if not wanted:  # A batch of registrations, say.
            return
        missing = []
        for job_id, rank in set(wanted):
            ranks = self._jobs.get(job_id)
            if ranks is not None:
                self._jobs.move_to_end(job_id)
            if ranks is None or rank not in ranks:
                missing.append((job_id, rank))
        for (job_id, rank), key in self.store.result_keys(missing, self._jobs).items():
            if key is None:
                self._gone.add(job_id)
                self._jobs.pop(job_id, None)
            elif key:  # A rank not registered (yet) is asked for again next time.
                self._jobs.setdefault(job_id, {})[rank] = key
        while len(self._jobs) > _JOBS_CACHED:
            self._jobs.popitem(last=False)

    def check(self, message: ReportResult, fields: dict[bytes, bytes]) -> None:
        """Raise unless the entry's MAC is its rank's (call :meth:`load` for it first).

        Raises:
            UnknownJobError: Redis does not have the job (deleted, or lost in a restart).
            ProtocolError: The rank is not registered with the job.
            WrongTokenError: The MAC is missing or made with another token.
        """
        rank = message.result.rank
        if message.job_id in self._gone:
            raise UnknownJobError(f"unknown job id {message.job_id!r}")
        key = self._jobs.get(message.job_id, {}).get(rank, "")
        if not key:
            raise ProtocolError(f"rank {rank} is not registered with job {message.job_id}")
        if not verify(key, fields[b"data"], fields.get(b"mac")):
            # Nothing derived from the token goes into the reason.
            how = "no mac field" if b"mac" not in fields else "its mac is of another token"
            raise WrongTokenError(
                f"wrong token for rank {rank} of job {message.job_id} ({how}): results count "
                "only from the process that registered the rank"
            )

    def forget(self, job_id: str) -> None:
        """Drop a deleted job's keys."""
        self._jobs.pop(job_id, None)
