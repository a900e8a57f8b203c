"""Ranks listed in a message or a table: the first few named, the rest counted."""

from __future__ import annotations

from collections.abc import Sequence

NAMED = 10
"""Ranks a message names of one kind; a 100,000-rank job made lines of hundreds of kB."""


def few_ranks(ranks: Sequence[int], named: int = NAMED) -> str:
    """``ranks`` joined by commas, or the first ``named`` of them and a count of the rest.

    ``few_ranks([3, 7])`` is ``"3, 7"``; with 4,993 ranks it is ``"3, 7, ..., 88, ... and
    4,983 more (4,993 in all)"``. Counts get thousands separators, ranks do not (they are
    listed with commas already).

    Args:
        ranks: The ranks, in the order to name them (callers sort them).
        named: How many to name at most.
    """
    shown = ", ".join(str(r) for r in ranks[:named])
    if len(ranks) <= named:
        return shown
    return f"{shown}, ... and {len(ranks) - named:,} more ({len(ranks):,} in all)"
