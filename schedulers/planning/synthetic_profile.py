"""The one synthetic H100-like instruction profile model, and profiles built from it.

Every synthetic profile in perseus-mq comes from :func:`synthetic_profile_rows`: the simulated
GPU's replay table (:func:`worker_client.simulated.instruction_table.synthetic_instruction_table`),
the demo, and the planner's benchmark and tests (:func:`synthetic_rows`, :func:`synthetic_profile`).

Model, with ``x = f / f_max``: ``time = t_max * x**-alpha`` (``alpha < 1`` because part of the
work is memory-bound and does not speed up with the clock) and ``power = p_static +
p_dynamic * x**3``. Energy ``power * time`` is then smallest at ``x = (alpha * p_static /
((3 - alpha) * p_dynamic)) ** (1/3)``, about 1070 MHz with the defaults: energy falls and then
rises again as the clock drops, as measured on real GPUs (the Pareto-suboptimal tail that the
profiler stops at). At the max clock an instruction draws 600 W. Backward takes twice as long as
forward and the last stage is heavier (it carries the LM head), which is what gives Perseus
something to save. :func:`synthetic_rows` keeps every ``stride``-th clock to make planning
faster: ``synthetic_rows(n, stride=s)`` has exactly the rows of
``synthetic_instruction_table(n, H100_GRAPHICS_CLOCKS[::s])``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from protocol.constants import H100_GRAPHICS_CLOCKS, INSTRUCTIONS
from schedulers.planning.profile_csv import InstructionProfile, ProfileRow, build_profile
from schedulers.planning.profile_writer import write_profile_rows

SyntheticRow = tuple[int, str, int, float, float]
"""``(stage, instruction, frequency MHz, time s, energy J)``."""


def default_imbalance(num_stages: int) -> list[float]:
    """Default per-stage time weights: 1.0, except 1.2 on the last of several stages.

    The last stage also runs the LM head and the loss.
    """
    if num_stages < 1:
        raise ValueError(f"need at least one stage, got {num_stages}")
    return [1.0] * (num_stages - 1) + [1.2 if num_stages > 1 else 1.0]


def synthetic_profile_rows(
    num_stages: int,
    frequencies: Iterable[int] = H100_GRAPHICS_CLOCKS,
    base_forward_time: float = 0.012,
    imbalance: Sequence[float] | None = None,
    seed: int | random.Random = 0,
    *,
    backward_ratio: float = 2.0,
    alpha: float = 0.8,
    p_static_w: float = 180.0,
    p_dynamic_w: float = 420.0,
    jitter: float = 0.0,
) -> list[SyntheticRow]:
    """Tabulate the model (module docs) for ``forward``/``backward`` of ``num_stages`` stages.

    Args:
        num_stages: Number of pipeline stages.
        frequencies: Graphics clocks to tabulate (MHz, any order); the max is ``f_max``.
        base_forward_time: Forward time of a weight-1.0 stage at ``f_max``, seconds.
        imbalance: Per-stage time weights (default :func:`default_imbalance`).
        seed: Seed of the ``jitter``, or a generator to draw it from (advanced in place, so
            that the caller can keep drawing from the same sequence).
        backward_ratio: Backward time / forward time.
        alpha: Frequency sensitivity of the time.
        p_static_w: Frequency-independent power under load, Watts.
        p_dynamic_w: Power that scales with ``x**3`` (voltage follows the clock), Watts.
        jitter: Relative std of a fixed, seeded per-row perturbation of time and power, so
            that curves are not perfectly smooth (as measured profiles are not).

    Returns:
        One row per stage, instruction (forward first) and clock (ascending).

    Raises:
        ValueError: No stage, no frequency, or ``imbalance`` of the wrong length.

    """
    freqs = sorted({int(f) for f in frequencies})
    if num_stages < 1 or not freqs:
        raise ValueError("need at least one stage and one frequency")
    if imbalance is None:
        imbalance = default_imbalance(num_stages)
    if len(imbalance) != num_stages:
        raise ValueError(f"imbalance has {len(imbalance)} weights for {num_stages} stages")
    f_max = freqs[-1]
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    rows: list[SyntheticRow] = []
    for stage, weight in enumerate(imbalance):
        for inst, ratio in (("forward", 1.0), ("backward", backward_ratio)):
            t_max = base_forward_time * weight * ratio
            for f in freqs:
                x = f / f_max
                t = t_max * x**-alpha
                p = p_static_w + p_dynamic_w * x**3
                if jitter > 0:
                    t *= max(0.5, rng.gauss(1.0, jitter))
                    p *= max(0.5, rng.gauss(1.0, jitter))
                rows.append((stage, inst, f, t, p * t))
    return rows


def synthetic_rows(
    num_stages: int,
    *,
    stride: int = 4,
    clocks: Sequence[int] = H100_GRAPHICS_CLOCKS,
    weights: Sequence[float] | None = None,
    **model: Any,
) -> list[ProfileRow]:
    """Rows of a synthetic short-form profile.

    Args:
        num_stages: Pipeline stages.
        stride: Keep every ``stride``-th clock, counting from the highest (always kept).
        clocks: Available clocks, MHz.
        weights: Relative work per stage; default :func:`default_imbalance`.
        **model: Further parameters of :func:`synthetic_profile_rows`, e.g.
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
