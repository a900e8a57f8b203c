"""clock_sync="events": clock changes wait for the GPU on a side thread, not the training one."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from protocol.exceptions import ConfigError, GPUError
from tests.helpers import wait_for
from tests.rank_helpers import make_hook, run_step, write_1f1b_plan
from worker_client.gpu.frequency import DryRunFrequencyController
from worker_client.hook.clock_requests import ClockRequester

FORWARD, BACKWARD = 1980, 1965


class Gate:
    """A marker whose synchronize() blocks until the test opens it (the GPU 'reaching' it)."""

    def __init__(self) -> None:
        self.reached = threading.Event()

    def synchronize(self) -> None:
        assert self.reached.wait(10), "the test never opened this marker"


class Gates:
    """marker_fn: hands out gates and keeps them; opens every one at once when ``open``."""

    def __init__(self, open: bool = False) -> None:
        self.made: list[Gate] = []
        self.open = open

    def __call__(self) -> Gate:
        gate = Gate()
        if self.open:
            gate.reached.set()
        self.made.append(gate)
        return gate


class Slow(DryRunFrequencyController):
    """A controller that takes 50 ms a request (a side thread's request lands late)."""

    def set_frequency(self, frequency: int) -> None:
        time.sleep(0.05)
        super().set_frequency(frequency)


class Failing(DryRunFrequencyController):
    """A controller whose requests fail once ``fail`` is set."""

    fail = False

    def set_frequency(self, frequency: int) -> None:
        if self.fail:
            raise GPUError("NVML nvmlDeviceSetGpuLockedClocks on GPU 0 failed: no permission")
        super().set_frequency(frequency)


def _plan(tmp_path: Path) -> str:
    path = tmp_path / "plan.py"
    write_1f1b_plan(path, 1, 2, [(FORWARD, BACKWARD)])
    return path.read_text()


@pytest.fixture
def events_hook(gloo, hook_service, redis_url, tmp_path):
    """Makes one-rank hooks with clock_sync="events" on a plan whose F and B clocks differ."""
    _coord, start_worker = hook_service
    start_worker()
    hooks = []

    def make(controller, gates: Gates, **kw):
        hook = make_hook(
            redis_url,
            controller,
            report_every=1,
            scheduler="PointSolution",
            scheduler_args={"plan_text": _plan(tmp_path)},
            clock_sync="events",
            marker_fn=gates,
            **kw,
        )
        hooks.append(hook)
        return hook

    yield make
    for hook in hooks:
        hook.close()


def test_a_clock_is_requested_only_once_the_gpu_reached_its_marker(events_hook):
    controller, gates = DryRunFrequencyController(0), Gates()
    hook = events_hook(controller, gates)
    # The profiling step (report_every=1) synchronizes and applies each change before the
    # instruction it is for, as clock_sync="wait" does.
    run_step(hook)
    assert hook.syncs == 2 + 2 * 4 and not gates.made
    assert [f for _, f in controller.records] == [FORWARD, BACKWARD, FORWARD, BACKWARD]

    # After the report: no measurement, so no wait on the training thread.
    before, requested = hook.syncs, len(controller.records)
    hook.on_step_begin()
    hook.on_instruction_begin("forward")  # BACKWARD -> FORWARD: a marker, no request yet
    assert len(gates.made) == 1
    time.sleep(0.2)
    assert len(controller.records) == requested  # the GPU has not reached it
    gates.made[0].reached.set()
    wait_for(lambda: len(controller.records) == requested + 1, 5, "the clock request")
    assert controller.records[-1][1] == FORWARD
    hook.on_instruction_end("forward")
    gates.open = True
    for name in ("backward", "forward", "backward"):
        hook.on_instruction_begin(name)
        hook.on_instruction_end(name)
    hook.on_step_end()
    assert hook.syncs == before  # a step that is not measured never waits
    assert len(gates.made) == 4  # one marker per clock change
    wait_for(lambda: len(controller.records) == requested + 4, 5, "every request")
    assert [f for _, f in controller.records[requested:]] == [FORWARD, BACKWARD] * 2
    hook.close()
    assert not hook._clocks.is_alive()


def test_a_failed_request_is_raised_at_the_next_step_end(events_hook):
    controller = Failing(0)
    hook = events_hook(controller, Gates(open=True))
    run_step(hook)
    controller.fail = True
    hook.on_step_begin()
    for name in ("forward", "backward") * 2:
        hook.on_instruction_begin(name)
        hook.on_instruction_end(name)
    wait_for(lambda: hook._clocks.error is not None, 5, "the failed request")
    with pytest.raises(GPUError, match="no permission"):
        hook.on_step_end()
    with pytest.raises(GPUError, match="no permission"):  # and at every later one
        hook.on_step_end()


def test_a_failed_request_in_a_profiling_window_stops_it_unreported(events_hook):
    controller = Failing(0)
    controller.fail = True
    hook = events_hook(controller, Gates())
    hook.on_step_begin()
    with pytest.raises(GPUError, match="no permission"):  # as clock_sync="wait" does
        hook.on_instruction_begin("forward")
    assert not hook._reported and hook._iter_time == []


def test_a_timed_instruction_starts_once_its_clock_was_requested(events_hook):
    """Each instruction's clock reached the controller before its timing starts, also when the
    previous (unmeasured) step's last request is still on its way."""
    controller = Slow(0)
    in_force: list[int | None] = []  # the last clock requested, at each reading of the clock

    def clock() -> float:
        in_force.append(controller.records[-1][1] if controller.records else None)
        return time.perf_counter()

    hook = events_hook(controller, Gates(open=True), clock=clock)
    run_step(hook)  # measured: each reading after a begin sees that instruction's clock
    assert in_force[1:9:2] == [FORWARD, BACKWARD, FORWARD, BACKWARD], in_force
    run_step(hook)  # not measured: four requests queued, 50 ms each
    assert len(controller.records) < 8
    hook._reset_window()  # what a new schedule version does: measure again
    hook.on_step_begin()  # waits for the previous step's requests
    assert len(controller.records) == 8
    hook.abandon_step()


def test_bad_clock_sync_settings_are_refused_before_registering(gloo, r, redis_url, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="clock_sync must be 'wait' or 'events', got 'never'"):
        make_hook(redis_url, DryRunFrequencyController(0), clock_sync="never")
    # No CUDA: the default marker (a CUDA event) cannot be made.
    with pytest.raises(ConfigError, match="needs CUDA events"):
        make_hook(redis_url, DryRunFrequencyController(0), clock_sync="events")
    assert r.dbsize() == 0  # nothing was registered


def test_requester_serves_in_order_and_stops_after_the_last_request():
    controller = DryRunFrequencyController(0)
    requester = ClockRequester(controller)
    requester.start()
    gates = [Gate() for _ in range(3)]
    for gate, frequency in zip(gates, (1980, 1500, 1200), strict=True):
        requester.request(frequency, gate)
    time.sleep(0.1)
    assert controller.records == []  # waiting on the first marker
    for gate in reversed(gates):  # reached in any order: still requested in queue order
        gate.reached.set()
    requester.request(1100, None, wait=True)  # returns once applied
    assert [f for _, f in controller.records] == [1980, 1500, 1200, 1100]
    requester.stop()
    assert not requester.is_alive() and requester.applied == 4 and requester.error is None


def test_stop_drops_the_requests_of_a_marker_never_reached():
    controller = DryRunFrequencyController(0)
    requester = ClockRequester(controller)
    requester.start()
    gate = Gate()
    requester.request(1500, gate)
    assert requester.stop(timeout=0.2) is False  # the GPU never got there
    gate.reached.set()
    time.sleep(0.1)
    # The controller may be stopped by now: nothing calls it from this thread any more.
    assert controller.records == [] and not requester.is_alive()


def test_a_request_after_stop_is_refused_not_left_waiting_for_ever():
    # The hook closed from another thread while a step runs: its next timed instruction's
    # request used to wait for a thread that had ended.
    controller = DryRunFrequencyController(0)
    requester = ClockRequester(controller)
    requester.start()
    requester.request(1500, None, wait=True)
    assert requester.stop() is True
    raised: list[BaseException] = []

    def request() -> None:
        try:
            requester.request(1200, None, wait=True)
        except GPUError as exc:
            raised.append(exc)

    waiting = threading.Thread(target=request, daemon=True)
    waiting.start()
    waiting.join(30)
    assert not waiting.is_alive(), "the request waited for a stopped requester"
    assert len(raised) == 1 and isinstance(raised[0], GPUError), raised
    assert "stopped" in str(raised[0])
    with pytest.raises(GPUError, match="stopped"):
        requester.flush()
    assert [f for _, f in controller.records] == [1500]
