"""The order a training step must follow: the schedule's instructions, one open at a time."""

from __future__ import annotations

from protocol.exceptions import ScheduleError
from protocol.models import FrequencySchedule


class StepOrder:
    """Checks a rank's hook calls against its schedule and gives each instruction's clock.

    Args:
        rank: The rank (for messages).
        schedule: The schedule the next step runs.
    """

    def __init__(self, rank: int, schedule: FrequencySchedule) -> None:
        self.rank = rank
        self.in_step = False
        self.open: str | None = None  # the instruction begun and not ended yet
        self.restart(schedule)

    def restart(self, schedule: FrequencySchedule) -> None:
        """The next step starts at ``schedule``'s first instruction."""
        self.schedule = schedule
        self._next = 0  # index of the instruction the schedule expects next

    def begin_step(self) -> None:
        """A step begins (a step begun again starts clean, at the first instruction)."""
        self.in_step = True
        self.open = None
        self.restart(self.schedule)

    def begin(self, name: str) -> int:
        """Instruction ``name`` begins: return its planned clock.

        Raises:
            ScheduleError: No step is open, another instruction is, or ``name`` is not the
                instruction the schedule expects next.
        """
        if not self.in_step or self.open is not None:
            raise self._misuse(f"on_instruction_begin({name!r})")
        schedule = self.schedule
        if self._next >= len(schedule.frequencies):
            raise ScheduleError(
                f"rank {self.rank}: instruction {name!r} but schedule version "
                f"{schedule.version} has only {len(schedule.frequencies)} instructions "
                f"({self._shape()})"
            )
        expected, frequency = schedule.frequencies[self._next]
        if expected != name:  # not consumed: the step still expects it (a caught error)
            names = {n for n, _ in schedule.frequencies}  # only on this error path: no cost
            if name not in names:  # misspelt: not a microbatch count problem, as others may be
                raise ScheduleError(
                    f"rank {self.rank}: {name!r} is no instruction of schedule version "
                    f"{schedule.version} (it has {', '.join(repr(n) for n in sorted(names))})"
                )
            raise ScheduleError(
                f"rank {self.rank}: expected instruction {expected!r} but got {name!r} "
                f"(schedule version {schedule.version}: {self._shape()})"
            )
        self._next += 1
        self.open = name
        return frequency

    def end(self, name: str) -> None:
        """Instruction ``name`` ends.

        Raises:
            ScheduleError: It is not the instruction open.
        """
        if self.open != name:
            raise self._misuse(f"on_instruction_end({name!r})")
        self.open = None

    def end_step(self) -> bool:
        """The step ends: return whether one was open.

        Raises:
            ScheduleError: No step is open (while the schedule has instructions), an
                instruction is still open, or the schedule expects more.
        """
        if self.open is not None or (not self.in_step and self.schedule.frequencies):
            raise self._misuse("on_step_end()")
        if self._next < len(self.schedule.frequencies):
            name, frequency = self.schedule.frequencies[self._next]
            raise ScheduleError(
                f"rank {self.rank}: step ended but schedule version {self.schedule.version} "
                f"still expects {name!r} at {frequency} MHz"
            )
        was_open, self.in_step = self.in_step, False
        return was_open

    def abandon(self) -> None:
        """Forget the step in progress; the next one starts at the first instruction."""
        self.in_step = False
        self.open = None
        self.restart(self.schedule)

    def _shape(self) -> str:
        """What a step of the schedule runs, e.g. a plan made for another microbatch count."""
        names = [name for name, _ in self.schedule.frequencies]
        counts = ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))
        return f"{counts} per step; does the training loop run that many microbatches?"

    def _misuse(self, call: str) -> ScheduleError:
        """The error for a hook called out of order, saying what was expected."""
        if not self.in_step:
            expected = "no step is open: call on_step_begin() first"
        elif self.open is None:
            expected = "no instruction is open"
        else:
            expected = f"{self.open!r} is still open: call on_instruction_end({self.open!r})"
        return ScheduleError(f"rank {self.rank}: {call}, but {expected}")
