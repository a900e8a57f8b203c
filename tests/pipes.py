"""A process's piped output, read by a thread of its own: every wait bounded, nothing lost."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Output:
    """What a process prints on its piped text stdout, read by a thread of its own.

    Every wait on it is bounded, and nothing is lost: ``communicate()`` after a ``readline()``
    reads the descriptor itself and drops what the line reader had buffered past its line.
    """

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None, "the process's stdout is not piped"
        self.proc = proc
        self.lines: list[str] = []
        self._taken = 0  # lines handed out by readline() or rest()
        self._ended = False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, pipe: Any) -> None:
        with pipe:
            for line in pipe:
                with self._changed:
                    self.lines.append(line)
                    self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def text(self) -> str:
        """Everything read so far."""
        with self._changed:
            return "".join(self.lines)

    def readline(self, timeout: float) -> str:
        """The next line; ``""`` once the output ended.

        Raises:
            AssertionError: No line came within ``timeout`` s (what came so far is in it).
        """
        with self._changed:
            if not self._changed.wait_for(
                lambda: self._taken < len(self.lines) or self._ended, timeout
            ):
                raise AssertionError(
                    f"no line within {timeout} s from {self.proc.args}; "
                    f"it printed: {''.join(self.lines)[-2000:]!r}"
                )
            if self._taken == len(self.lines):
                return ""
            self._taken += 1
            return self.lines[self._taken - 1]

    def rest(self, timeout: float) -> str:
        """What it printed after the lines handed out, once it exited.

        Children that outlive it may hold the pipe open: then what came within ``timeout`` s.

        Raises:
            AssertionError: It still ran ``timeout`` s on (what it printed is in it).
        """
        deadline = time.monotonic() + timeout
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.proc.args} still ran {timeout} s on; it printed: {self.text()[-2000:]!r}"
            ) from None
        self._reader.join(max(0.0, deadline - time.monotonic()))
        with self._changed:
            rest = "".join(self.lines[self._taken :])
            self._taken = len(self.lines)
        return rest


@contextmanager
def piped(proc: subprocess.Popen[str], stop_s: float = 10.0) -> Iterator[Output]:
    """``proc``'s :class:`Output` inside the block; ``proc`` stopped after it if it still runs.

    SIGTERM first (so that it can stop what it started, as `perseus redis` its server), then
    SIGKILL after ``stop_s`` s.
    """
    try:
        yield Output(proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=stop_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
