"""What InstructionProfiler measures: results it takes, an instruction's average, a clock sweep."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from protocol.constants import INSTRUCTIONS
from protocol.exceptions import ProtocolError
from protocol.models import ProfilingResult


def check_every_instruction(result: ProfilingResult) -> None:
    """Every instruction must be there: without one, the sweep could not go on.

    Raises:
        ProtocolError: An instruction has no times in ``result``.
    """
    for name in INSTRUCTIONS:
        if name not in result.time_breakdown:
            raise ProtocolError(
                f"rank {result.rank}, schedule version {result.schedule_version}: no "
                f"{name!r} times in the result; InstructionProfiler measures every "
                "forward and backward (does the training loop call on_instruction_begin "
                "and on_instruction_end for each?)"
            )


def check_per_microbatch(result: ProfilingResult, args: dict[str, Any]) -> None:
    """Each instruction once per microbatch (of the job's ``args``), and an iteration past warm-up.

    Raises:
        ProtocolError: An iteration holds another count of times, or every one is warm-up.
    """
    # Every stage runs each instruction once per microbatch, under 1F1B and GPipe alike.
    expected = args.get("microbatches")
    warmup_iters = args.get("warmup_iters", 1)
    if not isinstance(expected, int) or not isinstance(warmup_iters, int):
        return  # Refused at registration; nothing to compare with.
    who = f"rank {result.rank}, schedule version {result.schedule_version}"
    for name in INSTRUCTIONS:
        times = result.time_breakdown[name]
        for i, iteration in enumerate(times):
            if len(iteration) != expected:
                raise ProtocolError(
                    f"{who}: time_breakdown[{name!r}][{i}] has {len(iteration)} times; "
                    f"expected {expected}, one per microbatch (microbatches={expected})"
                )
        if len(times) <= warmup_iters:
            raise ProtocolError(
                f"{who}: time_breakdown[{name!r}] has {len(times)} iteration(s), all of "
                f"them warm-up (warmup_iters={warmup_iters}); set the hook's report_every "
                "above it"
            )


def instruction_average(
    res: ProfilingResult,
    stage: int,
    inst: str,
    expected: int,
    warmup_iters: int,
    microbatches: int,
) -> tuple[float, float]:
    """Mean time and energy of one instruction in one rank's result, warm-up dropped.

    Args:
        res: One rank's result.
        stage: The rank's pipeline stage (for messages).
        inst: The instruction, ``"forward"`` or ``"backward"``.
        expected: How many times the stage runs ``inst`` in an iteration.
        warmup_iters: Leading iterations to drop.
        microbatches: The job's microbatches (for messages).

    Raises:
        ProtocolError: The result lacks per-instruction energy, ``inst``, or an iteration's
            worth of figures, or holds only warm-up.
    """
    who = f"rank {res.rank} (stage {stage}), schedule version {res.schedule_version}"
    if not res.energy_breakdown:
        raise ProtocolError(
            f"{who}: the result has no energy_breakdown; InstructionProfiler needs "
            "per-instruction energy: create PerseusOptimizer with instruction_energy=True"
        )
    times = res.time_breakdown.get(inst)
    energies = res.energy_breakdown.get(inst)
    if times is None or energies is None:
        raise ProtocolError(f"{who}: no {inst!r} in time_breakdown or energy_breakdown")
    if len(times) != len(energies):
        raise ProtocolError(
            f"{who}: {inst!r} has {len(times)} iterations of times but {len(energies)} of energies"
        )
    for i, (ts, es) in enumerate(zip(times, energies, strict=True)):
        if len(ts) != expected or len(es) != expected:
            raise ProtocolError(
                f"{who}: iteration {i} has {len(ts)} {inst!r} times and {len(es)} energies; "
                f"expected {expected} (microbatches={microbatches})"
            )
    kept_t = [x for it in times[warmup_iters:] for x in it]
    kept_e = [x for it in energies[warmup_iters:] for x in it]
    if not kept_t:
        raise ProtocolError(
            f"{who}: {len(times)} iteration(s) reported, all of them warm-up "
            f"(warmup_iters={warmup_iters}); set the hook's report_every above it"
        )
    return math.fsum(kept_t) / len(kept_t), math.fsum(kept_e) / len(kept_e)


@dataclass
class Sweep:
    """The clock sweep of one (stage, instruction), highest clock first.

    Attributes:
        frequencies: Clocks to sweep, MHz, highest first.
        measured: Clocks measured so far, in sweep order.
        energies: Stage-average energy at each measured clock, J.
        rises: Consecutive energy rises so far.
        stopped: No more clocks to measure.

    """

    frequencies: list[int]
    measured: list[int] = field(default_factory=list)
    energies: list[float] = field(default_factory=list)
    rises: int = 0
    stopped: bool = False

    @property
    def current(self) -> int:
        """The clock the next version measures."""
        return self.frequencies[len(self.measured)]

    def record(self, frequency: int, energy: float, stop_after_rises: int) -> None:
        """Add the measurement of ``frequency`` and decide whether to stop."""
        if self.energies and energy > self.energies[-1]:
            self.rises += 1
        else:
            self.rises = 0
        self.measured.append(frequency)
        self.energies.append(energy)
        if self.rises >= stop_after_rises or len(self.measured) >= len(self.frequencies):
            self.stopped = True
