"""Replay: the optimizer, run on fake GPUs, ends at the exhaustive optimum of every selector.

The fake GPUs (tests/fake_nvml_power.py) step on a virtual clock with the step time and power
that TABLE gives for the limit they are at; evaluation at each epoch end runs at its own
power. The expected limit is computed here from TABLE alone, with each selector's definition
written out (not by calling the selector).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests import fake_nvml_power as fake
from tests.fake_nvml_power import ReplayMonitor, ReplayTraining, limits_now, run_steps
from tests.fake_nvml_power import describe_state as describe
from worker_client.power_limit.optimizer import (
    Done,
    Energy,
    GlobalPowerLimitOptimizer,
    MaxSlowdownConstraint,
    OptimumSelector,
    Time,
    ZeusCost,
)

# A measured-style table of a 100-250 W GPU: limit (W) -> (step time s, power per GPU W).
# Time barely moves near the top and climbs steeply at the bottom; energy per step is lowest
# at 125 W.
TABLE = {
    250: (0.2000, 236.0),
    225: (0.2012, 219.5),
    200: (0.2061, 196.8),
    175: (0.2170, 172.9),
    150: (0.2380, 148.6),
    125: (0.2791, 124.1),
    100: (0.3525, 99.2),
}
LADDER = list(TABLE)  # range(250, 100 - 1, -25)
GPUS = [0, 1]
WARMUP, PROFILE = 2, 4
EVAL_SECONDS = 7.0


def window(limit: int) -> tuple[float, float]:
    """(time, energy) of PROFILE steps at ``limit`` on every GPU, from TABLE alone."""
    seconds, watts = TABLE[limit]
    return PROFILE * seconds, len(GPUS) * PROFILE * seconds * watts


def exhaustive_optimum(kind: str, arg: float = 0.0, world: int = 1) -> int:
    """The limit each selector's definition picks over every ladder limit's window."""
    time = {pl: window(pl)[0] for pl in LADDER}
    energy = {pl: window(pl)[1] for pl in LADDER}
    if kind == "energy":
        return min(LADDER, key=energy.__getitem__)
    if kind == "time":
        return min(LADDER, key=time.__getitem__)
    if kind == "zeus":
        max_power = max(LADDER) * world
        cost = {pl: arg * energy[pl] + (1 - arg) * max_power * time[pl] for pl in LADDER}
        ranked = sorted(cost.values())
        assert ranked[1] - ranked[0] > 1e-6 * ranked[0], "TABLE must not make near-ties"
        return min(LADDER, key=cost.__getitem__)
    assert kind == "slowdown"
    yardstick = time[max(LADDER)]
    return min(pl for pl in LADDER if time[pl] <= arg * yardstick)


SELECTORS: list[tuple[OptimumSelector | None, tuple[Any, ...]]] = [
    (Energy(), ("energy",)),
    (Time(), ("time",)),
    (None, ("zeus", 0.5, len(GPUS))),  # the default
    *[
        (ZeusCost(eta, world), ("zeus", eta, world))
        for eta in (0.0, 0.25, 0.5, 0.75, 1.0)
        for world in (1, 2, 4)
    ],
    *[(MaxSlowdownConstraint(f), ("slowdown", f)) for f in (1.0, 1.01, 1.05, 1.1, 1.2, 1.5, 2.0)],
]
# (carry_across_epochs, steps per epoch): one long epoch; Zeus with epochs long enough to
# profile a limit; carry mode with epochs shorter than WARMUP + PROFILE.
REGIMES = [(False, None), (False, 13), (True, 13), (True, 4), (True, 2)]


@pytest.fixture
def training() -> ReplayTraining:
    fake.reset(num_gpus=len(GPUS), min_limit_mw=100_000, max_limit_mw=250_000)
    return ReplayTraining(TABLE, GPUS, idle_power_w=61.0)


def make(training: ReplayTraining, **kwargs: Any) -> GlobalPowerLimitOptimizer:
    return GlobalPowerLimitOptimizer(
        ReplayMonitor(training),
        wait_steps=1,
        warmup_steps=WARMUP,
        profile_steps=PROFILE,
        pl_step=25,
        restore_on_exit=False,
        **kwargs,
    )


def test_the_table_makes_the_selectors_disagree() -> None:
    picks = {exhaustive_optimum(*definition) for _, definition in SELECTORS}
    assert picks == set(LADDER)  # every limit is somebody's optimum


@pytest.mark.parametrize(("carry", "epoch_steps"), REGIMES)
@pytest.mark.parametrize(("selector", "definition"), SELECTORS, ids=repr)
def test_replay_ends_at_the_exhaustive_optimum(
    training: ReplayTraining,
    selector: OptimumSelector | None,
    definition: tuple[Any, ...],
    carry: bool,
    epoch_steps: int | None,
) -> None:
    opt = make(training, optimum_selector=selector, carry_across_epochs=carry)
    steps = 0
    while not isinstance(opt.state, Done):
        run_steps(opt, training, 1)
        steps += 1
        if epoch_steps is not None and steps % epoch_steps == 0:
            opt.on_epoch_end()
            training.idle(EVAL_SECONDS)
        assert steps < 2000, f"profiling did not finish: {opt.state}"
    best = exhaustive_optimum(*definition)
    assert opt.state.optimal_power_limit == best * 1000
    assert limits_now() == [best] * len(GPUS)
    # Every measurement is exactly PROFILE steps at its limit: no evaluation, no other limit.
    assert [m.power_limit for m in opt.measurements] == LADDER
    for m in opt.measurements:
        assert (m.time, m.energy) == pytest.approx(window(m.power_limit), rel=1e-12)
    run_steps(opt, training, 3)
    assert training.step_limits[-3:] == [best] * 3


def test_zeus_never_finishes_when_epochs_are_shorter_than_a_limit(
    training: ReplayTraining,
) -> None:
    opt = make(training)
    run_steps(opt, training, 600, epoch_steps=WARMUP + PROFILE - 1)
    assert opt.measurements == []
    assert not isinstance(opt.state, Done)
    carrying = make(training, carry_across_epochs=True)
    run_steps(carrying, training, 600, epoch_steps=WARMUP + PROFILE - 1)
    assert isinstance(carrying.state, Done)


def test_carry_pauses_the_window_over_the_epoch_end(training: ReplayTraining) -> None:
    opt = make(training, carry_across_epochs=True)
    monitor = opt.monitor
    assert isinstance(monitor, ReplayMonitor)
    trace = []
    for step in range(1, 15):
        run_steps(opt, training, 1)
        trace.append(describe(opt.state))
        if step in (5, 9):
            opt.on_epoch_end()
            trace.append(describe(opt.state) + f" at {limits_now()[0]} W")
            training.idle(EVAL_SECONDS)
    assert trace == [
        "Ready(250,1)",  # wait step
        "Warmup(250,2)",
        "Warmup(250,1)",
        "Profiling(250,4)",
        "Profiling(250,3)",
        "Paused(250,2,2) at 250 W",  # 2 of 4 steps measured; the GPUs are at the max anyway
        "Warmup(250,1)",  # first step of the epoch: not measured
        "Profiling(250,2)",
        "Profiling(250,1)",
        "Warmup(225,2)",  # 250 W measured over 4 steps in two windows
        "Paused(225,1,0) at 250 W",
        "Warmup(225,1)",
        "Profiling(225,4)",
        "Profiling(225,3)",
        "Profiling(225,2)",
        "Profiling(225,1)",
    ]
    name = "__perseus_power_limit_250"
    assert monitor.events[:4] == [("begin", name), ("end", name), ("begin", name), ("end", name)]
    assert (opt.measurements[0].time, opt.measurements[0].energy) == pytest.approx(window(250))


def test_carry_close_and_resume(training: ReplayTraining) -> None:
    opt = make(training, carry_across_epochs=True, optimum_selector=Time())
    run_steps(opt, training, 1 + 2 * (WARMUP + PROFILE) + WARMUP + PROFILE)
    # The window at 200 W holds all PROFILE steps; close() comes before the step that ends it.
    assert describe(opt.state) == "Profiling(200,1)"  # its last step begun
    opt.close()
    assert describe(opt.state) == f"Paused(200,{WARMUP},{PROFILE})"
    assert limits_now() == [250, 250]
    training.idle(EVAL_SECONDS)
    run_steps(opt, training, 1)  # complete: recorded at once, 175 W starts warming up
    assert describe(opt.state) == "Warmup(175,2)"
    assert [m.power_limit for m in opt.measurements] == [250, 225, 200]
    assert (opt.measurements[2].time, opt.measurements[2].energy) == pytest.approx(window(200))
    assert limits_now() == [175, 175]
