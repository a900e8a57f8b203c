"""Write a job's ranks, schedules and profiling results to files for later inspection.

Layout, one folder per job: ``<dump_dir>/<job_id>/ranks.json``, ``<version>.sched.json`` and
``<version>.prof.json`` (the results measured while running that version), plus ``job.json``.
Redis keeps only the newest schedules and the results not yet consumed by a scheduler
snapshot, so ``perseus dump`` writes what is left, plus ``summaries.json`` (each observed
version's rank count, iteration time and energy). With ``--dump-dir`` (``dump_data``) every
version is written as it is published, and the results a converged scheduler observes
without publishing one as they are recorded, so nothing is missed. ``perseus dump`` writes
``complete`` last: a folder without it holds a dump that failed part-way. :func:`load_ranks`,
:func:`load_sched` and :func:`load_prof` read those files back (Zeus's names and arguments).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from protocol.codec import validate
from protocol.exceptions import ConfigError, ProtocolError
from protocol.models import FrequencySchedule, ProfilingResult, RankInfo
from protocol.store import JobRecord, JobStore

M = TypeVar("M", bound=BaseModel)
COMPLETE = "complete"
"""The file :func:`dump_job` writes last: without it, the folder's dump stopped part-way."""


def _write(path: Path, payload: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def _dump_models(models: list[BaseModel]) -> list[dict[str, Any]]:
    return [m.model_dump(mode="json") for m in models]


def dump_version(store: JobStore, record: JobRecord, version: int, out_dir: str = "") -> Path:
    """Write the job's ranks and the schedule of ``version`` (and the results it observed)."""
    folder = Path(out_dir or record.config.dump_dir) / record.job_id
    folder.mkdir(parents=True, exist_ok=True)
    _write(
        folder / "job.json",
        {
            "info": record.info.model_dump(mode="json"),
            "config": record.config.model_dump(mode="json"),
        },
    )
    _write(folder / "ranks.json", _dump_models(list(store.ranks(record.job_id))))
    schedules = store.schedules(record.job_id, version)
    if schedules:  # Only the newest versions are kept.
        _write(folder / f"{version}.sched.json", _dump_models(list(schedules)))
    if version > 1:
        results = store.results(record.job_id, version - 1)
        if results:
            _write(folder / f"{version - 1}.prof.json", _dump_models(list(results)))
    return folder


def dump_observed(store: JobStore, record: JobRecord, version: int) -> Path:
    """Write the results observed for ``version`` when no new version followed them.

    A converged scheduler (``PointSolution``, say) publishes nothing after its observation,
    so :func:`dump_version` never writes these; Zeus's server dumps every round's results.
    """
    folder = Path(record.config.dump_dir) / record.job_id
    folder.mkdir(parents=True, exist_ok=True)
    results = store.results(record.job_id, version)
    if results:
        _write(folder / f"{version}.prof.json", _dump_models(list(results)))
    return folder


def dump_job(store: JobStore, job_id: str, out_dir: str) -> Path:
    """Write everything Redis holds about a job (``perseus dump``), :data:`COMPLETE` last.

    An earlier dump's :data:`COMPLETE` goes first, so that a dump that fails part-way (Redis
    hangs or goes away, the disk fills) leaves none: its files look like a whole dump.
    """
    record = store.get_job(job_id)  # an unknown job gets no folder
    folder = Path(out_dir) / job_id
    folder.mkdir(parents=True, exist_ok=True)
    (folder / COMPLETE).unlink(missing_ok=True)
    latest = store.version(job_id)
    for version in range(1, latest + 1):
        dump_version(store, record, version, out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    _write(
        folder / "job.json",
        {
            "info": record.info.model_dump(mode="json"),
            "config": record.config.model_dump(mode="json"),
            "fields": record.fields,
        },
    )
    _write(folder / "ranks.json", _dump_models(list(store.ranks(job_id))))
    results = store.results(job_id, latest) if latest else []
    if results:
        _write(folder / f"{latest}.prof.json", _dump_models(list(results)))
    for name, data in store.artifacts(job_id).items():
        # Artifact names come from schedulers: keep only the last path component.
        (folder / Path(name).name).write_bytes(data)
    journal = store.journal(job_id)
    _write(folder / "journal.json", _dump_models(list(journal)))
    _write(folder / "summaries.json", {str(v): s for v, s in store.summaries(job_id).items()})
    (folder / COMPLETE).write_text(f"perseus dump of {job_id} at schedule version {latest}\n")
    return folder


def _load_models(path: Path, model: type[M]) -> list[M]:
    """Read a JSON list of ``model`` written by this module; errors name the file and item.

    Raises:
        OSError: The file cannot be read (FileNotFoundError names it).
        ConfigError: It is not JSON, not a list, or an item is not a valid ``model``.
    """
    text = path.read_text(encoding="utf-8")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(raw, list):
        raise ConfigError(f"{path}: expected a JSON list of {model.__name__}")
    models = []
    for i, item in enumerate(raw):
        try:
            models.append(validate(model, item))
        except ProtocolError as exc:
            raise ConfigError(f"{path}: item {i}: {exc}") from None
    return models


def load_ranks(directory: str | Path) -> list[RankInfo]:
    """The ranks of a dumped job (``<directory>/ranks.json``)."""
    return _load_models(Path(directory) / "ranks.json", RankInfo)


def load_sched(directory: str | Path, schedule_num: int) -> list[FrequencySchedule]:
    """Every rank's schedule of version ``schedule_num`` (``<schedule_num>.sched.json``)."""
    return _load_models(Path(directory) / f"{schedule_num}.sched.json", FrequencySchedule)


def load_prof(directory: str | Path, schedule_num: int) -> list[ProfilingResult]:
    """The results measured while version ``schedule_num`` ran (``<schedule_num>.prof.json``)."""
    return _load_models(Path(directory) / f"{schedule_num}.prof.json", ProfilingResult)
