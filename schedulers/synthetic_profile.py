"""Synthetic instruction profiles for the planner's benchmarks, demos and tests.

The numbers come from the one synthetic model, :mod:`coordinator.synthetic_profile` (the
same one the simulated GPU replays): H100 clocks, ``time = t_max * x**-alpha`` and
``power = p_static + p_dynamic * x**3`` with ``x = f / f_max``, so energy has its minimum
inside the clock range (about 1070 MHz) and the clocks below it are the Pareto-suboptimal tail
the Perseus docs tell profilers to stop at. Backward takes twice as long as forward and the
last stage is heavier (it carries the LM head), which is what gives Perseus something to save.

This module only picks the clocks (every ``stride``-th one, to make planning faster) and
returns the rows in the planner's types. ``synthetic_rows(n, stride=s)`` has exactly the rows
of ``synthetic_instruction_table(n, H100_CLOCKS[::s])`` from
:mod:`worker_client.instruction_table`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coordinator.profile_csv import (
    INSTRUCTIONS,
    InstructionProfile,
    ProfileRow,
    build_profile,
    write_profile_rows,
)
from coordinator.synthetic_profile import (
    H100_GRAPHICS_CLOCKS,
    default_imbalance,
    synthetic_profile_rows,
)

H100_CLOCKS: tuple[int, ...] = H100_GRAPHICS_CLOCKS


def stage_weights(num_stages: int) -> list[float]:
    """Relative work per stage: 1.0, and 1.2 on the last of several stages (the LM head)."""
    return default_imbalance(num_stages)


def synthetic_rows(
    num_stages: int,
    *,
    stride: int = 4,
    clocks: Sequence[int] = H100_CLOCKS,
    weights: Sequence[float] | None = None,
    **model: Any,
) -> list[ProfileRow]:
    """Rows of a synthetic short-form profile.

    Args:
        num_stages: Pipeline stages.
        stride: Keep every ``stride``-th clock, counting from the highest (always kept).
        clocks: Available clocks, MHz.
        weights: Relative work per stage; default :func:`stage_weights`.
        **model: Further parameters of
            :func:`coordinator.synthetic_profile.synthetic_profile_rows`, e.g.
            ``base_forward_time``, ``backward_ratio``, ``alpha``, ``p_static_w``,
            ``p_dynamic_w``, ``jitter``, ``seed``.

    Returns:
        One row per stage, instruction and kept clock (forward first, clocks high to low).

    """
    if num_stages < 1 or stride < 1 or not clocks:
        raise ValueError("need num_stages >= 1, stride >= 1 and at least one clock")
    kept = sorted(set(clocks), reverse=True)[::stride]
    rows = synthetic_profile_rows(num_stages, kept, imbalance=weights, **model)
    rows.sort(key=lambda r: (r[0], INSTRUCTIONS.index(r[1]), -r[2]))
    return [ProfileRow(stage, inst, freq, t, e) for stage, inst, freq, t, e in rows]


def synthetic_profile(num_stages: int, **kwargs: Any) -> InstructionProfile:
    """Return :func:`synthetic_rows` as an :class:`InstructionProfile`."""
    return build_profile(synthetic_rows(num_stages, **kwargs))


def write_synthetic_profile(path: str | Path, num_stages: int, **kwargs: Any) -> Path:
    """Write :func:`synthetic_rows` as a short-form CSV and return its path."""
    write_profile_rows(path, synthetic_rows(num_stages, **kwargs))
    return Path(path)
