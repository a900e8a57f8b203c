"""A scheduler's output checked before it is published: one schedule per rank, its clocks only."""

from __future__ import annotations

from collections import Counter

from protocol.exceptions import ProtocolError
from protocol.models import FrequencySchedule, RankInfo
from protocol.rank_lists import NAMED, few_ranks


def _wrong_ranks(scheduler: str, got: list[int], expected: set[int]) -> str:
    """Why schedules for ranks ``got`` are not one for each of ``expected``, in a line.

    Names the ranks missing, extra and twice, a few of each: the error is stored on the job
    and sent to every rank's watcher, and listing every rank made it 1.2 MB at 100,000 ranks.
    """
    counts = Counter(got)
    seen = set(counts)
    twice = sorted(r for r, n in counts.items() if n > 1)
    parts = [
        f"{what} [{few_ranks(found)}]"
        for what, found in (
            ("missing ranks", sorted(expected - seen)),
            ("unexpected ranks", sorted(seen - expected)),
            ("ranks twice", twice),
        )
        if found
    ]
    if len(got) <= NAMED and len(expected) <= NAMED:
        parts.insert(0, f"expected one for each of {sorted(expected)}, got ranks {sorted(got)}")
    return f"scheduler {scheduler} returned {len(got)} schedules for {len(expected)} ranks: " + (
        "; ".join(parts)
    )


def check_schedules(
    schedules: list[FrequencySchedule],
    ranks: list[RankInfo],
    scheduler: str,
    allowed: dict[int, set[int]] | None = None,
) -> list[FrequencySchedule]:
    """Check a scheduler's output: exactly one schedule per rank, allowed frequencies only.

    Args:
        schedules: What the scheduler returned.
        ranks: The job's ranks.
        scheduler: Its name, for messages.
        allowed: Each rank's frequencies as a set, if already built.
    """
    by_rank = {s.rank: s for s in schedules}
    expected = {r.rank for r in ranks}
    if len(by_rank) != len(schedules) or set(by_rank) != expected:
        raise ProtocolError(_wrong_ranks(scheduler, [s.rank for s in schedules], expected))
    if allowed is None:
        allowed = {r.rank: set(r.available_frequencies) for r in ranks}
    for rank in ranks:
        ok = allowed[rank.rank]
        for i, (name, freq) in enumerate(by_rank[rank.rank].frequencies):
            if freq not in ok:
                raise ProtocolError(
                    f"scheduler {scheduler} gave rank {rank.rank} frequency {freq} MHz for "
                    f"instruction {i} ({name}), which its GPU does not support"
                )
    return [by_rank[r] for r in sorted(by_rank)]
