"""The replay profile of simulated instructions, and its synthetic H100-like instance.

:class:`InstructionTable` maps ``(stage, instruction, frequency)`` to ``(time_s, energy_j)``
and answers clocks between measured ones by interpolation; the simulated GPU
(:mod:`worker_client.simulated.gpu`) and the simulated training replay it.
:func:`synthetic_instruction_table` fills one from the shared synthetic model,
:mod:`schedulers.planning.synthetic_profile`.

Imports only the standard library and :mod:`schedulers.planning.synthetic_profile` (no torch, no
NVML), so that it is cheap to import anywhere.
"""

from __future__ import annotations

import bisect
import csv
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from protocol.constants import H100_GRAPHICS_CLOCKS
from schedulers.planning.synthetic_profile import synthetic_profile_rows

Key = tuple[int, str, int]


class InstructionTable(Mapping[Key, tuple[float, float]]):
    """Replay profile: ``(stage, instruction, frequency) -> (time_s, energy_j)``.

    As a mapping it holds only the measured rows. :meth:`lookup` also answers frequencies
    missing from the table: linear interpolation of time and energy between the two nearest
    measured frequencies, and the nearest measured frequency outside the measured range (no
    extrapolation: profiles usually stop before the lowest clocks, and a straight-line guess
    there can go negative).

    Args:
        rows: ``(stage, instruction, frequency, time_s, energy_j)`` tuples, or mappings with
            the CSV column names ``stage, instruction, frequency, time, energy`` (extra
            columns such as ``rank`` are ignored). Rows with the same key are averaged.
        noise: Relative standard deviation of the multiplicative Gaussian noise that
            :meth:`lookup` applies (0 = exact replay). Energy inherits the time factor, so a
            slow sample also costs more energy.
        seed: Seed of the noise generator.
        blocking_power_w: Power while blocked on communication (used by ``idle``), Watts.

    """

    def __init__(
        self,
        rows: Iterable[Sequence[Any] | Mapping[str, Any]],
        *,
        noise: float = 0.0,
        seed: int | None = None,
        blocking_power_w: float = 100.0,
    ) -> None:
        if noise < 0:
            raise ValueError(f"noise must be >= 0, got {noise}")
        sums: dict[Key, list[float]] = {}
        for row in rows:
            if isinstance(row, Mapping):
                values = [row[k] for k in ("stage", "instruction", "frequency", "time", "energy")]
            else:
                values = list(row)
            stage, inst, freq, t, e = values
            key = (int(stage), str(inst), int(freq))
            acc = sums.setdefault(key, [0.0, 0.0, 0.0])
            acc[0] += float(t)
            acc[1] += float(e)
            acc[2] += 1
        self._rows: dict[Key, tuple[float, float]] = {
            k: (t / n, e / n) for k, (t, e, n) in sums.items()
        }
        # Sorted frequencies per (stage, instruction) for interpolation.
        self._freqs: dict[tuple[int, str], list[int]] = {}
        for stage, inst, freq in sorted(self._rows):
            self._freqs.setdefault((stage, inst), []).append(freq)
        self.noise = noise
        self.blocking_power_w = blocking_power_w
        self._rng = random.Random(seed)

    @classmethod
    def from_csv(cls, path: str | Path, **kwargs: Any) -> InstructionTable:
        """Read a profile CSV (``stage,instruction,frequency,time,energy`` columns)."""
        with open(path, newline="") as f:
            return cls(list(csv.DictReader(f)), **kwargs)

    def to_csv(self, path: str | Path) -> None:
        """Write the measured rows as a profile CSV."""
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["stage", "instruction", "frequency", "time", "energy"])
            for (stage, inst, freq), (t, e) in sorted(self._rows.items()):
                writer.writerow([stage, inst, freq, t, e])

    def __getitem__(self, key: Key) -> tuple[float, float]:
        return self._rows[key]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def frequencies(self, stage: int, instruction: str) -> list[int]:
        """Measured frequencies of one instruction, ascending."""
        try:
            return list(self._freqs[(stage, instruction)])
        except KeyError:
            raise KeyError(f"no profile for stage {stage} instruction {instruction!r}") from None

    def expected(self, stage: int, instruction: str, frequency: int) -> tuple[float, float]:
        """Noise-free ``(time_s, energy_j)``, interpolated or nearest (see class docs)."""
        freqs = self.frequencies(stage, instruction)
        if frequency <= freqs[0]:
            return self._rows[(stage, instruction, freqs[0])]
        if frequency >= freqs[-1]:
            return self._rows[(stage, instruction, freqs[-1])]
        hi = bisect.bisect_left(freqs, frequency)
        if freqs[hi] == frequency:
            return self._rows[(stage, instruction, frequency)]
        f0, f1 = freqs[hi - 1], freqs[hi]
        (t0, e0), (t1, e1) = (
            self._rows[(stage, instruction, f0)],
            self._rows[(stage, instruction, f1)],
        )
        w = (frequency - f0) / (f1 - f0)
        return t0 + w * (t1 - t0), e0 + w * (e1 - e0)

    def lookup(self, stage: int, instruction: str, frequency: int) -> tuple[float, float]:
        """Like :meth:`expected`, with the table's multiplicative noise applied."""
        t, e = self.expected(stage, instruction, frequency)
        if self.noise > 0:
            # Clamp so a wild draw cannot produce a zero or negative duration.
            time_factor = max(0.05, self._rng.gauss(1.0, self.noise))
            power_factor = max(0.05, self._rng.gauss(1.0, self.noise))
            t, e = t * time_factor, e * time_factor * power_factor
        return t, e


def synthetic_instruction_table(
    num_stages: int,
    frequencies: Iterable[int] = H100_GRAPHICS_CLOCKS,
    base_forward_time: float = 0.012,
    imbalance: Sequence[float] | None = None,
    seed: int = 0,
    *,
    backward_ratio: float = 2.0,
    alpha: float = 0.8,
    p_static_w: float = 180.0,
    p_dynamic_w: float = 420.0,
    jitter: float = 0.0,
    noise: float = 0.0,
    blocking_power_w: float = 100.0,
) -> InstructionTable:
    """Build an H100-like profile of ``forward``/``backward`` for ``num_stages`` stages.

    The rows are :func:`schedulers.planning.synthetic_profile.synthetic_profile_rows` (see there for
    the model: energy is smallest around 1070 MHz with the defaults, 600 W at the max clock).

    Args:
        num_stages: Number of pipeline stages.
        frequencies: Graphics clocks to tabulate (MHz); the max is ``f_max``.
        base_forward_time: Forward time of a weight-1.0 stage at ``f_max``, seconds.
        imbalance: Per-stage time weights. Default: 1.0 everywhere except the last stage,
            1.2 (it also runs the LM head and the loss); 1.0 for a single stage.
        seed: Seed for ``jitter`` and ``noise``.
        backward_ratio: Backward time / forward time.
        alpha: Frequency sensitivity of the time.
        p_static_w: Frequency-independent power under load, Watts.
        p_dynamic_w: Power that scales with ``x**3`` (voltage follows the clock), Watts.
        jitter: Relative std of a fixed, seeded per-row perturbation baked into the table,
            so that curves are not perfectly smooth (as measured profiles are not).
        noise: Per-lookup noise of the returned table (see :class:`InstructionTable`).
        blocking_power_w: Power while blocked on P2P communication, Watts.

    """
    rng = random.Random(seed)
    rows = synthetic_profile_rows(
        num_stages,
        frequencies,
        base_forward_time,
        imbalance,
        rng,
        backward_ratio=backward_ratio,
        alpha=alpha,
        p_static_w=p_static_w,
        p_dynamic_w=p_dynamic_w,
        jitter=jitter,
    )
    # The noise seed is drawn after the jitter, from the same generator.
    return InstructionTable(
        rows, noise=noise, seed=rng.randrange(2**32), blocking_power_w=blocking_power_w
    )
