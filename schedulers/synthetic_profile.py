"""A synthetic but plausible instruction profile, for benchmarks, demos and tests.

The model is deliberately simple and deterministic:

* clocks are H100-like: 1980 MHz down to 345 MHz in 15 MHz steps (``stride`` keeps every
  n-th one to make planning faster);
* time at clock ``f`` is ``t_max * (alpha * f_max / f + 1 - alpha)``: a compute-bound share
  ``alpha`` slows down with the clock, the rest (memory, launches) does not;
* power is ``static + dynamic * (f / f_max) ** gamma`` (voltage drops with the clock), so
  energy ``power * time`` has its minimum inside the clock range: below it the static power
  burns for longer than the dynamic power saves, which is the Pareto-suboptimal tail the
  Perseus docs tell profilers to stop at;
* backward takes about twice as long as forward, and stages are imbalanced (the last stage
  carries the LM head, stage weights vary), which is what gives Perseus something to save.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from coordinator.profile_csv import (
    InstructionProfile,
    ProfileRow,
    build_profile,
    write_profile_rows,
)

H100_CLOCKS: tuple[int, ...] = tuple(range(1980, 344, -15))


def stage_weights(num_stages: int) -> list[float]:
    """Relative work per stage: a fixed, repeatable imbalance with the heaviest stage last."""
    pattern = (1.0, 0.82, 0.9, 0.76, 0.95, 0.86)
    weights = [pattern[s % len(pattern)] for s in range(num_stages)]
    weights[-1] = 1.15 if num_stages > 1 else 1.0  # Embedding/LM head land on the last stage.
    return weights


def synthetic_rows(
    num_stages: int,
    *,
    stride: int = 4,
    clocks: Sequence[int] = H100_CLOCKS,
    forward_time: float = 0.012,
    backward_ratio: float = 2.0,
    static_power: float = 200.0,
    dynamic_power: float = 500.0,
    gamma: float = 2.5,
    weights: Sequence[float] | None = None,
) -> list[ProfileRow]:
    """Rows of a synthetic short-form profile.

    Args:
        num_stages: Pipeline stages.
        stride: Keep every ``stride``-th clock (the highest is always kept).
        clocks: Available clocks, MHz, highest first.
        forward_time: Forward time of a weight-1 stage at the highest clock, seconds.
        backward_ratio: Backward time over forward time.
        static_power: Clock-independent power while computing, W.
        dynamic_power: Clock-dependent power at the highest clock, W.
        gamma: Exponent of the dynamic power in the clock.
        weights: Relative work per stage; default :func:`stage_weights`.

    Returns:
        One row per stage, instruction and kept clock (forward first, clocks high to low).

    """
    if num_stages < 1 or stride < 1 or not clocks:
        raise ValueError("need num_stages >= 1, stride >= 1 and at least one clock")
    kept = list(clocks)[::stride]
    f_max = max(clocks)
    weights = list(weights) if weights is not None else stage_weights(num_stages)
    rows: list[ProfileRow] = []
    for stage in range(num_stages):
        for inst, ratio, alpha in (("forward", 1.0, 0.8), ("backward", backward_ratio, 0.88)):
            t_max = forward_time * ratio * weights[stage]
            for freq in kept:
                x = freq / f_max
                time = t_max * (alpha / x + 1.0 - alpha)
                power = static_power + dynamic_power * x**gamma
                rows.append(ProfileRow(stage, inst, freq, time, power * time))
    return rows


def synthetic_profile(num_stages: int, **kwargs: object) -> InstructionProfile:
    """Return :func:`synthetic_rows` as an :class:`InstructionProfile`."""
    return build_profile(synthetic_rows(num_stages, **kwargs))  # type: ignore[arg-type]


def write_synthetic_profile(path: str | Path, num_stages: int, **kwargs: object) -> Path:
    """Write :func:`synthetic_rows` as a short-form CSV and return its path."""
    write_profile_rows(path, synthetic_rows(num_stages, **kwargs))  # type: ignore[arg-type]
    return Path(path)
