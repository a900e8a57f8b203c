"""Job records a coordinator keeps in memory: a job's degrees and scheduler never change."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping

from protocol.job_record import JobRecord
from protocol.store import JobStore

CACHED_JOBS = 10_000
"""Jobs whose record a coordinator keeps (the least recently used go first)."""


class RecordCache(Mapping[str, JobRecord]):
    """Records of the jobs a coordinator serves, by id, read from Redis once.

    Only a record's ``info`` and ``config`` may be read from here: they never change. Its
    bookkeeping ``fields`` are as they were when the record was loaded (or empty, for a job
    this coordinator created), so anything that needs them reads the job again.

    Args:
        store: Where records missing here are loaded from.
        size: Most records kept.
    """

    def __init__(self, store: JobStore, size: int = CACHED_JOBS) -> None:
        self.store = store
        self.size = size
        self._records: OrderedDict[str, JobRecord] = OrderedDict()

    def __getitem__(self, job_id: str) -> JobRecord:
        return self._records[job_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def load(self, job_ids: Iterable[str]) -> dict[str, JobRecord | None]:
        """Records of ``job_ids``: cached ones, the others in one pipeline (None: no such job)."""
        found: dict[str, JobRecord | None] = {}
        missing = []
        for job_id in set(job_ids):
            record = self._records.get(job_id)
            if record is None:
                missing.append(job_id)
            else:
                self._records.move_to_end(job_id)
                found[job_id] = record
        if missing:
            for job_id, loaded in self.store.get_jobs(missing).items():
                found[job_id] = loaded
                if loaded is not None:
                    self.add(loaded)
        return found

    def add(self, record: JobRecord) -> None:
        """Keep ``record`` (one this coordinator just stored, say: its ranks register next)."""
        self._records[record.job_id] = record
        self._records.move_to_end(record.job_id)
        while len(self._records) > self.size:
            self._records.popitem(last=False)

    def forget(self, job_id: str) -> None:
        """Drop a job's record (the job was deleted)."""
        self._records.pop(job_id, None)
