"""Write a job's ranks, schedules and profiling results to files for later inspection.

Layout, one folder per job: ``<dump_dir>/<job_id>/ranks.json``, ``<version>.sched.json`` and
``<version>.prof.json`` (the results measured while running that version), plus ``job.json``.
Redis keeps only the newest schedules and the results not yet consumed by a scheduler
snapshot, so ``perseus dump`` writes what is left, plus ``summaries.json`` (each observed
version's rank count, iteration time and energy), and names the versions whose files the
folder lacks (``job.json``'s ``missing``, and the line it prints). With ``--dump-dir``
(``dump_data``) every version is written as it is published, and the results a converged
scheduler observes without publishing one as they are recorded, so nothing is missed.
``perseus dump`` writes ``complete`` last: a folder without it holds a dump that failed
part-way. A scheduler's artifacts (``profile.csv``, say) go in ``artifacts/``
(:func:`artifact_path`), so that no name a scheduler chooses (``complete``, ``job.json``)
overwrites the dump's own files, or is overwritten by them. :func:`load_ranks`,
:func:`load_sched` and :func:`load_prof` read those files back (Zeus's names and arguments).
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from pydantic import BaseModel

from protocol.codec import validate
from protocol.exceptions import ConfigError, ProtocolError
from protocol.models import FrequencySchedule, ProfilingResult, RankInfo
from protocol.store import KEEP_SCHEDULES, JobRecord, JobStore

M = TypeVar("M", bound=BaseModel)
COMPLETE = "complete"
"""The file :func:`dump_job` writes last: without it, the folder's dump stopped part-way."""
ARTIFACTS = "artifacts"
"""The folder of a dump that holds the job's artifacts, one file each."""
# Kept as they are in an artifact's file name: what no file system reads specially. Anything
# else ('/', '%', a control character) is percent-encoded, so two names never share a file.
_PLAIN = frozenset(string.ascii_letters + string.digits + " !#$&'()+,-.;=@[]^_`{}~")


def artifact_path(folder: Path, name: str) -> Path:
    """Where :func:`dump_job` writes the artifact ``name``: ``folder/artifacts/<name>``.

    A name that is not a plain file name is percent-encoded (``a/b.csv`` is ``a%2Fb.csv``;
    ``.`` and ``..`` are ``%2E`` and ``%2E%2E``; an empty one is ``%``), one file per name.
    """
    encoded = "".join(c if c in _PLAIN else quote(c, safe="") for c in name)
    if encoded in ("", ".", ".."):
        encoded = "%2E" * len(encoded) or "%"
    return folder / ARTIFACTS / encoded


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
    _dump_schedule(store, record.job_id, version, folder)
    return folder


def _dump_schedule(store: JobStore, job_id: str, version: int, folder: Path) -> None:
    """Write the schedule of ``version`` and the results it observed, those Redis holds."""
    schedules = store.schedules(job_id, version)
    if schedules:  # Only the newest versions are kept.
        _write(folder / f"{version}.sched.json", _dump_models(list(schedules)))
    if version > 1:
        results = store.results(job_id, version - 1)
        if results:
            _write(folder / f"{version - 1}.prof.json", _dump_models(list(results)))


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


@dataclass
class JobDump:
    """What :func:`dump_job` wrote, and the versions whose files the folder lacks.

    Attributes:
        folder: ``<out_dir>/<job id>``.
        missing: ``"sched.json"`` / ``"prof.json"`` -> versions without that file in the
            folder (Redis no longer held them, and no earlier dump there wrote them); a kind
            with none is left out. Also in ``job.json`` as ``missing``.
    """

    folder: Path
    missing: dict[str, list[int]] = field(default_factory=dict)

    def note(self) -> str:
        """``; no 1.sched.json to 46.sched.json: ...`` for the printed line ('' if none)."""
        why = {
            "sched.json": f"Redis keeps a job's newest {KEEP_SCHEDULES} schedules only",
            "prof.json": (
                "a scheduler snapshot consumed those results (summaries.json keeps each "
                "version's rank count, iteration time and energy)"
            ),
        }
        return "".join(
            f"; no {_spans(versions, kind)}: {why[kind]}" for kind, versions in self.missing.items()
        )


def _spans(versions: list[int], kind: str) -> str:
    """``1.sched.json to 46.sched.json, 50.sched.json`` (runs of consecutive versions)."""
    runs: list[list[int]] = []
    for v in versions:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}.{kind}" if a == b else f"{a}.{kind} to {b}.{kind}" for a, b in runs)


def _missing(folder: Path, latest: int, observed: Iterable[int]) -> dict[str, list[int]]:
    """Versions whose schedule (1..``latest``) or results (``observed``) have no file here."""
    missing = {
        "sched.json": [
            v for v in range(1, latest + 1) if not (folder / f"{v}.sched.json").exists()
        ],
        "prof.json": [v for v in sorted(observed) if not (folder / f"{v}.prof.json").exists()],
    }
    return {kind: versions for kind, versions in missing.items() if versions}


def dump_job(store: JobStore, job_id: str, out_dir: str) -> JobDump:
    """Write everything Redis holds about a job (``perseus dump``), :data:`COMPLETE` last.

    An earlier dump's :data:`COMPLETE` goes first, so that a dump that fails part-way (Redis
    hangs or goes away, the disk fills) leaves none: its files look like a whole dump. Files
    Redis no longer holds (old schedules, results a snapshot consumed) are named in
    ``job.json``'s ``missing`` and in :meth:`JobDump.note`.
    """
    record = store.get_job(job_id)  # an unknown job gets no folder
    folder = Path(out_dir) / job_id
    folder.mkdir(parents=True, exist_ok=True)
    (folder / COMPLETE).unlink(missing_ok=True)
    latest = store.version(job_id)
    # The ranks once, not with each version (dump_version's way): a 5,000-rank job of 8
    # versions was read and written 9 times over.
    _write(folder / "ranks.json", _dump_models(list(store.ranks(job_id))))
    for version in range(1, latest + 1):
        _dump_schedule(store, job_id, version, folder)
    results = store.results(job_id, latest) if latest else []
    if results:
        _write(folder / f"{latest}.prof.json", _dump_models(list(results)))
    summaries = store.summaries(job_id)  # one per observed version, kept after its results
    missing = _missing(folder, latest, summaries)
    _write(
        folder / "job.json",
        {
            "info": record.info.model_dump(mode="json"),
            "config": record.config.model_dump(mode="json"),
            "fields": record.fields,
            "missing": missing,
        },
    )
    artifacts = store.artifacts(job_id)
    if artifacts:
        (folder / ARTIFACTS).mkdir(exist_ok=True)
    for name, data in artifacts.items():
        artifact_path(folder, name).write_bytes(data)
    journal = store.journal(job_id)
    _write(folder / "journal.json", _dump_models(list(journal)))
    _write(folder / "summaries.json", {str(v): s for v, s in summaries.items()})
    (folder / COMPLETE).write_text(f"perseus dump of {job_id} at schedule version {latest}\n")
    return JobDump(folder, missing)


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
