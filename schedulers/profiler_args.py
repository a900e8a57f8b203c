"""What InstructionProfiler's arguments may be, checked before any job runs."""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from protocol.constants import MAX_RANK_CLOCKS
from protocol.exceptions import ConfigError, ProtocolError
from protocol.models import RankInfo

#: Most microbatches a sweep may run: each version holds 2 instructions per microbatch for
#: every rank, so a job sending 2**28 made a worker build gigabytes of schedules per stage.
MAX_MICROBATCHES = 65_536


def check_counts(microbatches: int, warmup_iters: int, stop_after_rises: int) -> None:
    """Raise ConfigError unless the sweep's counts are in range."""
    if microbatches < 1:
        raise ConfigError(f"microbatches must be >= 1, got {microbatches}")
    if microbatches > MAX_MICROBATCHES:
        raise ConfigError(
            f"microbatches must be <= {MAX_MICROBATCHES}, got {microbatches} (every version "
            "holds 2 instructions per microbatch for every rank)"
        )
    if warmup_iters < 0:
        raise ConfigError(f"warmup_iters must be >= 0, got {warmup_iters}")
    if stop_after_rises < 1:
        raise ConfigError(f"stop_after_rises must be >= 1, got {stop_after_rises}")


def check_frequencies(frequencies: Sequence[int] | None) -> None:
    """Clocks to sweep: 1 to ``MAX_RANK_CLOCKS``, positive, none twice (None: every clock)."""
    if frequencies is None:
        return
    if not frequencies:
        raise ConfigError(
            "frequencies is empty: give at least one clock to profile (or leave it out to "
            "sweep every clock)"
        )
    # Before anything goes through the list: a job's list of 200,000 (in a 1 MiB entry)
    # held the coordinator for minutes, when duplicates were counted one clock at a time.
    if len(frequencies) > MAX_RANK_CLOCKS:
        raise ConfigError(
            f"frequencies lists {len(frequencies)} clocks, more than {MAX_RANK_CLOCKS} (the "
            "most a rank may register: every whole MHz up to 10 GHz)"
        )
    bad = [f for f in frequencies if f < 1]
    if bad:
        raise ConfigError(f"frequencies must be positive clocks in MHz, got {bad[0]}")
    twice = sorted(f for f, n in Counter(frequencies).items() if n > 1)
    if twice:
        raise ConfigError(f"frequencies lists {twice[0]} MHz more than once")


def check_rank_clocks(scheduler: str, restrict: object, rank: RankInfo) -> None:
    """Raise ProtocolError unless ``rank``'s GPU has every clock of ``restrict``.

    Checked when the rank registers: found by the constructor instead, the job failed when
    its first schedule was built, after every rank had registered.

    Args:
        scheduler: The scheduler's name, for the message.
        restrict: The ``frequencies`` argument (None or not a list: nothing to check).
        rank: The registering rank.
    """
    if not isinstance(restrict, list | tuple):
        return
    lacking = sorted(set(restrict) - set(rank.available_frequencies), reverse=True)
    if lacking:
        clocks = rank.available_frequencies
        raise ProtocolError(
            f"rank {rank.rank} (stage {rank.pp_rank}): its GPU lacks {lacking} MHz of "
            f"{scheduler}'s scheduler argument frequencies={list(restrict)} (it has "
            f"{len(clocks)} clocks, {max(clocks)}..{min(clocks)} MHz); profile only clocks "
            "every GPU supports, or leave frequencies out to sweep each stage's own"
        )


def check_writable(name: str, path: Path, folder: bool) -> None:
    """Raise ConfigError unless ``path`` can be written as a file (or made as a folder)."""
    if path.is_dir() and not folder:
        raise ConfigError(f"{name} {path} is a folder; name the CSV file to write")
    if path.exists() and not path.is_dir() and folder:
        raise ConfigError(f"{name} {path} is a file; name a folder (it is made if missing)")
    parent = path if folder else path.parent
    while not parent.exists():  # the folders are made when written
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{name} {path}: {parent} is not a folder")
    # A file made and removed, not os.access: that says yes to root where nothing can be
    # made (/proc, a read-only bind mount under a writable folder's name).
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".perseus-write-check-"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if parent == path:
            raise ConfigError(f"{name} {path}: cannot write in this folder ({reason})") from None
        # Name what was given first: "cannot write in /proc" for /proc/x read as a wrong path.
        made = "folder" if folder else "file"
        raise ConfigError(
            f"{name} {path}: cannot make this {made}, as nothing can be made in {parent} ({reason})"
        ) from None
