"""Setting the GPU graphics clock from the training loop without stalling it.

:class:`FrequencyController` hands clock changes to a side process that owns NVML, so the
training process pays only for a non-blocking pipe write per clock change (a pipe, not a
``multiprocessing.Queue``: no feeder thread, and no named semaphores in ``/dev/shm`` that a
process ending with ``os._exit`` would leak). The side process is started with the ``spawn``
method: forking a process that has initialized CUDA (or merely imported torch with its
threads) is unsafe. As with any spawned process, a training script
that creates a controller must guard its entry point with ``if __name__ == "__main__":``.

:class:`DryRunFrequencyController` has the same interface and changes nothing: it records the
requested clocks, for machines whose clocks must not change.

``device_index`` is the NVML index of the GPU, which differs from the CUDA ordinal when
``CUDA_VISIBLE_DEVICES`` reorders or hides devices; the caller maps one to the other.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import signal
import time
import weakref
from multiprocessing.connection import Connection
from multiprocessing.util import Finalize
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, Literal

from protocol.constants import H100_GRAPHICS_CLOCKS
from protocol.exceptions import ConfigError, GPUError
from worker_client.gpu.nvml import NVML, REAL_NVML, SIMULATED_NVML

logger = logging.getLogger(__name__)

_PARENT_CHECK_S = 0.5  # how often an idle side process checks that its parent lives
# multiprocessing exit finalizers run highest first; PerseusOptimizer's exit close is 10.
STOP_AT_EXIT_PRIORITY = 5

# Clocks the dry-run controller reports when no NVML module is given (a measured H100).
_H100_MEMORY_CLOCK = 2619


# --- side process ------------------------------------------------------------------------------
def _send(status: Connection, message: tuple[Any, ...]) -> None:
    with contextlib.suppress(OSError):  # the parent is gone: nobody to tell
        status.send(message)


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the clock-resetting finally block


def _serve(
    nvml: NVML, index: int, commands: Connection, status: Connection, parent_pid: int
) -> None:
    """Apply clock requests until told to stop or the parent dies (or closes its end)."""
    last: int | None = None

    def apply(freq: int | None) -> None:
        nonlocal last
        if freq is None or freq == last:
            return
        try:
            nvml.lock_gpu_clocks(index, freq)
            last = freq
        except GPUError as exc:
            _send(status, ("error", str(exc)))

    while True:
        if not commands.poll(_PARENT_CHECK_S):
            if os.getppid() != parent_pid:  # re-parented: the trainer died without stop()
                return
            continue
        # Only the newest of several waiting clocks matters: the instructions that wanted
        # the older ones have already run.
        batch = []
        try:
            batch.append(commands.recv())
            while commands.poll():
                batch.append(commands.recv())
        except EOFError:  # the trainer closed its end: stopped, or gone
            return
        pending: int | None = None
        for item in batch:
            if isinstance(item, int):
                pending = item
            elif item[0] == "flush":
                apply(pending)
                pending = None
                _send(status, ("flushed", item[1]))
            elif item[0] == "stop":
                return  # clocks are reset anyway: pending requests do not matter
        apply(pending)


def _side_process(
    index: int, nvml_module: str, commands: Connection, status: Connection, parent_pid: int
) -> None:
    """Entry point of the side process that owns NVML for one GPU."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which stops us
    signal.signal(signal.SIGTERM, _raise_exit)
    nvml: NVML | None = None
    locked = False
    try:
        nvml = NVML(nvml_module)
        memory_clock = nvml.memory_clocks(index)[0]
        graphics_clocks = nvml.graphics_clocks(index, memory_clock)
        # Profiles are taken at the max memory clock; keep it from wandering.
        nvml.lock_memory_clocks(index, memory_clock)
        locked = True
        _send(status, ("ready", memory_clock, graphics_clocks))
        _serve(nvml, index, commands, status, parent_pid)
    except GPUError as exc:
        _send(status, ("error", str(exc)))
    except Exception as exc:
        _send(status, ("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if nvml is not None and locked:
            for reset in (nvml.reset_gpu_clocks, nvml.reset_memory_clocks):
                try:
                    reset(index)
                except GPUError as exc:
                    _send(status, ("error", str(exc)))
        if nvml is not None:
            with contextlib.suppress(GPUError):
                nvml.shutdown()
        _send(status, ("bye",))  # EOF without this means the process was killed
        status.close()


# --- parent side -------------------------------------------------------------------------------
_SPAWN_NOTE = (
    "Its side process is started with multiprocessing's 'spawn', which imports the training "
    'script again: a script whose code is not under `if __name__ == "__main__":`'
)


_side_processes: weakref.WeakSet[Any] = weakref.WeakSet()  # every controller's, while it lives


def _forget_side_processes() -> None:
    """In a plain fork of a trainer: its side processes are the parent's, not the fork's.

    multiprocessing counts them among the fork's children (it resets that set only in children
    of its own), so a fork leaving through ``sys.exit`` terminated the parent's side processes
    (daemons) at its exit: the parent's next clock request raised.
    """
    children = getattr(mp.process, "_children", None)
    if isinstance(children, set):
        children.difference_update(_side_processes)


os.register_at_fork(after_in_child=_forget_side_processes)


class FrequencyController:
    """Sets one GPU's graphics clock through a side process that owns NVML.

    At start the side process locks the memory clock to its max; :meth:`set_frequency`
    requests a graphics clock; :meth:`stop` (also run at interpreter exit, and by the side
    process itself when the parent dies) resets both clocks. Errors of the side process are
    raised as :class:`GPUError` by the next :meth:`set_frequency`, :meth:`flush` or
    :meth:`stop`. Not thread-safe: use one controller from one thread.

    Args:
        device_index: NVML index of the GPU.
        nvml_module: Import name of the NVML module (``"pynvml"``; the simulated GPU
            ``"worker_client.simulated.gpu"``; a fake in tests).
        start_timeout: Seconds to wait for the side process to take over the GPU.

    Raises:
        GPUError: The side process could not start or lock the memory clock.

    """

    def __init__(
        self, device_index: int, nvml_module: str = REAL_NVML, *, start_timeout: float = 60.0
    ) -> None:
        self.device_index = device_index
        self.nvml_module = nvml_module
        self.memory_clock = 0
        self.graphics_clocks: list[int] = []
        self._last: int | None = None
        self._stopped = False
        self._flushes = 0
        self._flushed = 0
        self._errors: list[str] = []
        self._child_gone = False
        ctx = mp.get_context("spawn")
        commands_end, self._commands = ctx.Pipe(duplex=False)
        self._status, child_end = ctx.Pipe(duplex=False)
        # A request must never block the trainer: a full pipe (a side process stuck in a
        # driver call) keeps the newest clock here until it drains (_send_command).
        os.set_blocking(self._commands.fileno(), False)
        self._unsent: int | None = None
        self._process = ctx.Process(
            target=_side_process,
            args=(device_index, nvml_module, commands_end, child_end, os.getpid()),
            name=f"perseus-frequency-gpu{device_index}",
            # Daemonic, so a parent that skips stop() never waits on it at exit.
            daemon=True,
        )
        self._process.start()
        _side_processes.add(self._process)
        child_end.close()  # so that the child's exit reads as EOF here
        commands_end.close()  # so that closing ours reads as EOF there
        # Stopped at interpreter exit by multiprocessing's exit function (also at the end of a
        # multiprocessing child, which skips atexit): before it terminates its daemonic
        # children (this side process), and after the hook's own exit close (priority 10),
        # which hands its last clock requests over first. Never in a fork of this process.
        self._at_exit = Finalize(None, self._stop_at_exit, exitpriority=STOP_AT_EXIT_PRIORITY)
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            with contextlib.suppress(GPUError):
                self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        if not self._status.poll(timeout):
            raise GPUError(
                f"frequency controller for GPU {self.device_index} did not start in {timeout}s. "
                f"{_SPAWN_NOTE} runs (and waits in) its training there instead"
            )
        self._read_status()
        if self.graphics_clocks:
            return
        # Gone before saying a word (no NVML error of its own): it died importing the script.
        died_silent = self._child_gone and len(self._errors) == 1 and self._process.exitcode == 1
        reason = "; ".join(self._errors) or f"exit code {self._process.exitcode}"
        if died_silent:
            reason += f" (see its traceback above). {_SPAWN_NOTE} fails there"
        self._errors.clear()
        raise GPUError(f"frequency controller for GPU {self.device_index} failed: {reason}")

    def _read_status(self) -> None:
        """Consume every message the side process has sent."""
        while not self._child_gone and self._status.poll():
            try:
                message = self._status.recv()
            except (EOFError, OSError):
                self._child_gone = True
                self._process.join(timeout=5)
                if not self._stopped:
                    self._errors.append(
                        f"side process exited unexpectedly (exit code {self._process.exitcode})"
                    )
                break
            kind = message[0]
            if kind == "bye":
                self._child_gone = True
                self._process.join(timeout=5)
            elif kind == "ready":
                self.memory_clock, self.graphics_clocks = message[1], list(message[2])
            elif kind == "flushed":
                self._flushed = max(self._flushed, message[1])
            elif kind == "error":
                self._errors.append(message[1])

    def _raise_errors(self) -> None:
        if self._errors:
            text = "; ".join(self._errors)
            self._errors.clear()
            self._last = None  # a failed request may be retried with the same clock
            raise GPUError(f"frequency controller for GPU {self.device_index}: {text}")

    def _check_usable(self) -> None:
        if self._stopped:
            raise GPUError(f"frequency controller for GPU {self.device_index} is stopped")
        if self._child_gone:
            raise GPUError(f"frequency controller for GPU {self.device_index} has exited")

    def set_frequency(self, frequency: int) -> None:
        """Request ``frequency`` MHz; returns at once (the side process applies it).

        Raises:
            GPUError: An earlier request failed, or the side process is gone.

        """
        if self._stopped:
            raise GPUError(f"frequency controller for GPU {self.device_index} is stopped")
        if self._status.poll():  # cheap: a zero-timeout poll of a pipe
            self._read_status()
            self._raise_errors()
        self._check_usable()
        if frequency != self._last:
            self._last = frequency
            self._unsent = int(frequency)  # supersedes a clock the full pipe kept back
        if self._unsent is not None and self._send_command(self._unsent):
            self._unsent = None

    def _send_command(self, item: int | tuple[Any, ...]) -> bool:
        """Write one request without blocking; False: the pipe is full (try again later).

        Each request is a few bytes, so one write puts all of it in the pipe or none.

        Raises:
            GPUError: The side process is gone.
        """
        try:
            self._commands.send(item)
        except BlockingIOError:
            return False
        except OSError:  # EPIPE: the side process closed its end, i.e. exited
            self._process.join(timeout=5)
            self._read_status()
            self._raise_errors()
            self._check_usable()
            raise GPUError(f"frequency controller for GPU {self.device_index} has exited") from None
        return True

    def flush(self, timeout: float = 10.0) -> None:
        """Block until every earlier request has been applied (e.g. before measuring).

        Raises:
            GPUError: A request failed, the side process is gone, or ``timeout`` passed.

        """
        self._check_usable()
        self._flushes += 1
        deadline = time.monotonic() + timeout
        for item in ([self._unsent] if self._unsent is not None else []) + [
            ("flush", self._flushes)
        ]:
            while not self._send_command(item):  # a full pipe: the side process lags
                if time.monotonic() >= deadline:
                    raise GPUError(
                        f"frequency controller for GPU {self.device_index}: flush timeout"
                    )
                time.sleep(0.001)
        self._unsent = None
        while self._flushed < self._flushes and not self._child_gone:
            left = deadline - time.monotonic()
            if left <= 0 or not self._status.poll(left):
                raise GPUError(f"frequency controller for GPU {self.device_index}: flush timeout")
            self._read_status()
        self._raise_errors()
        self._check_usable()

    def stop(self, timeout: float = 10.0) -> None:
        """Reset the clocks and end the side process (idempotent).

        Raises:
            GPUError: A request or the reset failed.

        """
        if self._stopped:
            return
        self._stopped = True
        self._at_exit.cancel()
        if self._process.is_alive():
            with contextlib.suppress(OSError):  # full, or the side process is gone
                self._commands.send(("stop",))
        # Read as EOF after whatever is in the pipe: a side process that missed "stop" ends too.
        self._commands.close()
        if self._process.is_alive():
            self._process.join(timeout)
        if self._process.is_alive():  # stuck in a driver call: SIGTERM still resets
            self._process.terminate()
            self._process.join(5)
        with contextlib.suppress(OSError):
            while not self._child_gone and self._status.poll():
                self._read_status()
        self._status.close()
        self._raise_errors()

    def _stop_at_exit(self) -> None:
        try:
            self.stop()
        except GPUError as exc:
            logger.warning("%s", exc)

    def __enter__(self) -> FrequencyController:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class DryRunFrequencyController:
    """Same interface as :class:`FrequencyController`, but never touches a clock.

    Records every request as ``(unix time, frequency)`` in :attr:`records`, and optionally
    appends it as a JSON line ``{"t", "device", "frequency"}`` to ``log_path``.

    Args:
        device_index: GPU index (only recorded).
        log_path: Optional JSONL file to append requests to.
        nvml_module: If given, the supported clocks are read (read-only) from this NVML
            module; otherwise those of an H100 are reported.

    """

    def __init__(
        self,
        device_index: int,
        log_path: str | Path | None = None,
        nvml_module: str | None = None,
    ) -> None:
        self.device_index = device_index
        self.records: list[tuple[float, int]] = []
        self.memory_clock = _H100_MEMORY_CLOCK
        self.graphics_clocks = list(H100_GRAPHICS_CLOCKS)
        if nvml_module is not None:
            nvml = NVML(nvml_module)
            try:
                self.memory_clock = nvml.memory_clocks(device_index)[0]
                self.graphics_clocks = nvml.graphics_clocks(device_index, self.memory_clock)
            finally:
                nvml.shutdown()
        self._log: IO[str] | None = (
            open(log_path, "a", buffering=1) if log_path is not None else None
        )
        self._stopped = False

    def set_frequency(self, frequency: int) -> None:
        """Record a request."""
        if self._stopped:
            raise GPUError(f"dry-run controller for GPU {self.device_index} is stopped")
        now = time.time()
        self.records.append((now, int(frequency)))
        if self._log is not None:
            line = {"t": now, "device": self.device_index, "frequency": int(frequency)}
            self._log.write(json.dumps(line) + "\n")

    def flush(self, timeout: float = 10.0) -> None:
        """Nothing to wait for."""

    def stop(self) -> None:
        """Close the log file (idempotent)."""
        self._stopped = True
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> DryRunFrequencyController:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


ControllerKind = Literal["nvml", "dry-run", "simulated"]


def make_controller(
    kind: ControllerKind,
    device_index: int,
    *,
    log_path: str | Path | None = None,
    start_timeout: float = 60.0,
    nvml_module: str = REAL_NVML,
) -> FrequencyController | DryRunFrequencyController:
    """Build a controller: NVML, dry run (records only), or the simulated GPU.

    Args:
        kind: ``"nvml"`` (clocks through ``nvml_module``), ``"dry-run"`` or ``"simulated"``.
        device_index: NVML index of the GPU.
        log_path: JSONL request log of the dry-run controller.
        start_timeout: Start timeout of the side process (``"nvml"``/``"simulated"``).
        nvml_module: The NVML module of ``"nvml"`` (the hook passes its own).

    """
    if kind == "nvml":
        return FrequencyController(device_index, nvml_module, start_timeout=start_timeout)
    if kind == "simulated":
        return FrequencyController(device_index, SIMULATED_NVML, start_timeout=start_timeout)
    if kind == "dry-run":
        return DryRunFrequencyController(device_index, log_path=log_path)
    raise ConfigError(f"unknown controller kind {kind!r} (nvml, dry-run or simulated)")
