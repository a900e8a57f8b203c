"""``perseus optimize`` and ``perseus choose``: compute the frontier of plans and pick one.

Exported as click commands (:data:`optimize_command`, :data:`choose_command`) that the
``perseus`` group registers. Heavy imports (lowtime, matplotlib) happen inside the commands.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
import redis

from protocol import keys
from protocol.cli_options import (
    connect_or_fail,
    lost_redis_message,
    redact_url,
    redis_url_option,
)
from protocol.cli_types import FiniteFloatRange
from protocol.connection import DEFAULT_REDIS_URL
from protocol.exceptions import ConfigError, PerseusError
from protocol.pipeline_schedules import DEFAULT_SCHEDULE, PIPELINE_SCHEDULES
from schedulers.planning.choose import choose_plan
from schedulers.planning.frontier_compute import p2p_unset_note
from schedulers.planning.frontier_files import FRONTIER_PNG, load_frontier, timeline_png_name
from schedulers.planning.frontier_plans import ensure_plan_file
from schedulers.planning.job import enqueue_planning
from schedulers.planning.pipeline_dag import MAX_INSTRUCTIONS, check_instructions
from schedulers.planning.plan_file import read_plan_file
from schedulers.planning.planner import PLAN_FILES, SOLVERS, plan_frontier
from schedulers.planning.profile_csv import profile_warnings, read_profile_csv


class _ProgressLine:
    """Render ``(fraction, message)`` progress: one rewritten line on a terminal, else 10% steps."""

    def __init__(self, width: int = 30) -> None:
        self.width = width
        self.tty = sys.stderr.isatty()
        self.last_decile = -1
        self.last_text = ""

    def __call__(self, fraction: float, message: str) -> None:
        filled = round(fraction * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        text = f"[{bar}] {fraction * 100:5.1f}% {message}"
        if self.tty:
            if text != self.last_text:
                pad = max(0, len(self.last_text) - len(text))
                click.echo("\r" + text + " " * pad, err=True, nl=False)
                self.last_text = text
        elif int(fraction * 10) > self.last_decile:
            self.last_decile = int(fraction * 10)
            click.echo(text, err=True)

    def close(self) -> None:
        if self.tty and self.last_text:
            click.echo(err=True)


P2P_DEFAULT_NOTE = p2p_unset_note("--p2p-power")


def _fail(exc: Exception) -> click.ClickException:
    if isinstance(exc, OSError) and exc.filename:
        # A read-only or missing folder: one line naming the path, no traceback.
        return click.ClickException(f"{exc.filename}: {exc.strerror or exc}")
    return click.ClickException(str(exc))


def _check_size(stages: int, microbatches: int, limit: int) -> None:
    """Raise a usage error for a pipeline of more than ``limit`` instructions, before any work.

    Checked before the profile is read or Redis asked: ``-m 640000`` (a typo for 64) built a
    DAG of millions of instructions, and the planner hung or ran out of memory. The planner
    checks again, with the same function (every path to it does).
    """
    try:
        check_instructions(
            stages,
            microbatches,
            limit,
            shape=f"--stages {stages} x --microbatches {microbatches}",
            raise_with="give --max-instructions N",
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def _redis_watch_hint(url: str, key: str) -> str:
    if url.startswith("unix://"):
        return f"redis-cli -s {shlex.quote(url[len('unix://') :].split('?')[0])} HGETALL {key}"
    return f"redis-cli -u {shlex.quote(url)} HGETALL {key}"


@click.command(
    "optimize",
    epilog="Outputs in DIR: freqs_pipeline_%05d.py (a larger number is a shorter iteration; "
    "with --plans chosen only the no-slowdown and min-energy ones), plans.delta (every plan's "
    "clocks), frontier.csv (the plans; dominated ones marked), allmax.csv (the all-max-clock "
    "reference), frontier.json, profile.csv and, with --plot, frontier.png and "
    "timeline_<plan>.png. Files of these names left by an earlier run are deleted first.",
)
@click.argument("profile", type=click.Path(exists=True, dir_okay=False))
@click.option("--stages", "-s", type=click.IntRange(min=1), required=True, help="Stages.")
@click.option(
    "--microbatches",
    "-m",
    type=click.IntRange(min=1),
    required=True,
    help="Microbatches per iteration.",
)
@click.option(
    "--schedule",
    type=click.Choice(PIPELINE_SCHEDULES),
    default=DEFAULT_SCHEDULE,
    show_default=True,
    help="Pipeline schedule the training runs: 1f1b (Schedule1F1B, Megatron, DeepSpeed) or "
    "gpipe (ScheduleGPipe: all forwards, then all backwards). Recorded in every plan.",
)
@click.option(
    "--p2p-power",
    type=FiniteFloatRange(min=0),
    default=0.0,
    show_default=True,
    help="GPU power while blocked on P2P communication, W.",
)
@click.option(
    "--unit-time",
    type=FiniteFloatRange(min=0, min_open=True),
    default=0.001,
    show_default=True,
    help="Solver time unit, s. Instruction times are rounded down to it; the solver takes one "
    "step per unit, so a larger unit is faster and coarser.",
)
@click.option(
    "--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Output folder."
)
@click.option(
    "--solver",
    type=click.Choice(SOLVERS),
    default="auto",
    show_default=True,
    help="native: the compiled core; python: the same algorithm in pure Python; lowtime: "
    "lowtime 0.3, the (much slower) reference; auto: native if it was built, else python.",
)
@click.option(
    "--plans",
    type=click.Choice(PLAN_FILES),
    default="all",
    show_default=True,
    help="Write every plan file, or only the no-slowdown and min-energy ones (perseus choose "
    "writes any other from plans.delta when it picks it).",
)
@click.option("--plot/--no-plot", default=True, show_default=True, help="Draw PNGs too.")
@click.option(
    "--max-instructions",
    type=click.IntRange(min=1),
    default=MAX_INSTRUCTIONS,
    show_default=True,
    help="Refuse a pipeline of more instructions (2 x stages x microbatches): planning time "
    "grows about with their square (a typo such as -m 640000 would run for weeks).",
)
@click.option(
    "--enqueue",
    is_flag=True,
    help="Run on an rq worker (queue 'perseus') instead of here; DIR must be reachable by it.",
)
@redis_url_option(default_help="Used with --enqueue. Default: redis://localhost:6379/0.")
def optimize_command(
    profile: str,
    stages: int,
    microbatches: int,
    schedule: str,
    p2p_power: float,
    unit_time: float,
    out_dir: str,
    solver: str,
    plans: str,
    plot: bool,
    max_instructions: int,
    enqueue: bool,
    redis_url: str | None,
) -> None:
    """Compute every Pareto-optimal frequency plan of a pipeline from a PROFILE CSV.

    PROFILE has columns stage,instruction,frequency,time,energy (or the per-rank form with
    rank,dp_rank,pp_rank,tp_rank in front; other columns are ignored). Then pick a plan with
    `perseus choose DIR`.
    """
    _check_size(stages, microbatches, max_instructions)
    try:
        prof = read_profile_csv(profile, num_stages=stages)
    except PerseusError as exc:
        raise _fail(exc) from None
    for note in profile_warnings(prof, unit_time):
        click.echo(f"warning: {note}", err=True)
    source = click.get_current_context().get_parameter_source("p2p_power")
    if source is click.core.ParameterSource.DEFAULT:
        click.echo(f"warning: {P2P_DEFAULT_NOTE}", err=True)
    if enqueue:
        _enqueue(
            prof,
            stages,
            microbatches,
            p2p_power,
            unit_time,
            out_dir,
            plot,
            redis_url,
            {"solver": solver, "plans": plans, "schedule": schedule},
            max_instructions,
        )
        return

    bar = _ProgressLine()
    try:
        result = plan_frontier(
            prof,
            stages,
            microbatches,
            out_dir=out_dir,
            p2p_power=p2p_power,
            unit_time=unit_time,
            progress=bar,
            schedule=schedule,
            solver=solver,
            plans=plans,
            max_instructions=max_instructions,
        )
    except (PerseusError, OSError) as exc:
        raise _fail(exc) from None
    finally:
        bar.close()
    pts, ref, meta = result.points, result.allmax, result.meta
    best = choose_plan(result.out_dir, "no-slowdown")
    least = choose_plan(result.out_dir, "min-energy")
    files = "" if plans == "all" else f", plan files for {best.plan} and {least.plan} only"
    pareto = result.pareto
    click.echo(
        f"{len(pareto)} Pareto-optimal plans ({len(pts) - len(pareto)} dominated) in "
        f"{result.out_dir} ({meta['timings']['total_s']:.1f} s, solver {meta['solver']}{files}): "
        f"{min(p.iteration_time for p in pareto):.4f} s to "
        f"{max(p.iteration_time for p in pareto):.4f} s per iteration"
    )
    click.echo(f"all-max clocks: {ref.iteration_time:.4f} s, {ref.energy_with_p2p:.1f} J")
    click.echo(
        f"no slowdown:    plan {best.plan}, {best.iteration_time:.4f} s, "
        f"{best.energy_with_p2p:.1f} J (saves {best.saving_j:.1f} J, {best.saving_pct:.1f}%)"
    )
    click.echo(
        f"min energy:     plan {least.plan}, {least.iteration_time:.4f} s, "
        f"{least.energy_with_p2p:.1f} J (saves {least.saving_pct:.1f}%, "
        f"{least.slowdown_pct:+.1f}% time)"
    )
    click.echo(f"times:          {TIMES_NOTE}")
    click.echo(
        f"rounding:       the solver rounds instruction times down to {unit_time:g} s; these "
        f"times exceed its quantized ones by < {result.rounding_bound:.4f} s "
        f"({meta['max_path_instructions']} instructions on the longest path) and may be "
        "shorter (each instruction gets the slowest clock within its solver time)"
    )
    if plot:
        from schedulers.planning.plots import plot_run  # matplotlib: only when plotting

        try:
            paths = plot_run(result.out_dir, best.plan)
        except OSError as exc:
            raise _fail(exc) from None
        click.echo(f"plots:          {paths['frontier']}, {paths['timeline']}")
    click.echo(f"next:           perseus choose {shlex.quote(str(result.out_dir))} --policy ...")


def _enqueue(
    prof: Any,
    stages: int,
    microbatches: int,
    p2p_power: float,
    unit_time: float,
    out_dir: str,
    plot: bool,
    redis_url: str | None,
    options: dict[str, str],
    max_instructions: int,
) -> None:
    conn = connect_or_fail(redis_url)
    try:
        pid = enqueue_planning(
            conn,
            prof,
            stages,
            microbatches,
            out_dir=out_dir,
            p2p_power=p2p_power,
            unit_time=unit_time,
            plot=plot,
            max_instructions=max_instructions,
            **options,
        )
    except (redis.TimeoutError, redis.ConnectionError) as exc:
        raise click.ClickException(lost_redis_message(exc)) from None
    except redis.RedisError as exc:
        where = redact_url(redis_url or DEFAULT_REDIS_URL)
        raise click.ClickException(f"cannot reach Redis at {where}: {exc}") from None
    except PerseusError as exc:
        raise _fail(exc) from None
    key = keys.plan_key(pid)
    click.echo(f"plan id: {pid}")
    click.echo(f"queued on rq queue '{keys.RQ_QUEUE}'; output: {Path(out_dir).resolve()}")
    click.echo(f"watch:   {_redis_watch_hint(redact_url(redis_url or DEFAULT_REDIS_URL), key)}")
    click.echo("         (state: queued/running/done/failed, progress 0..1, message, num_plans)")


#: How every time the planner prints is computed and rounded (said once per output).
TIMES_NOTE = (
    "longest path with the profile's times at the plan's clocks, shown to 0.1 ms "
    "(frontier.csv holds them unrounded)"
)

_POLICY_HELP = (
    "no-slowdown | min-energy | max-slowdown FACTOR | deadline SECONDS | straggler SECONDS. "
    "Give the value with --value or inside the policy: --policy 'max-slowdown 1.1' "
    "or --policy deadline=2.5."
)


@click.command(
    "choose",
    epilog="no-slowdown: least energy no slower than all-max clocks (allowing the solver's "
    "time rounding); min-energy: least energy overall; max-slowdown FACTOR (>= 1): within "
    "FACTOR x the all-max time; deadline SECONDS: within SECONDS, error if impossible; "
    "straggler SECONDS: within a straggler's iteration time, else the fastest plan.",
)
@click.argument("frontier_dir", metavar="DIR", type=click.Path(file_okay=False))
@click.option("--policy", "-p", default="no-slowdown", show_default=True, help=_POLICY_HELP)
@click.option("--value", type=float, default=None, help="The policy's FACTOR or SECONDS.")
@click.option(
    "--plot", is_flag=True, help="Draw the frontier with the plan marked, and its timeline."
)
@click.option(
    "--copy-to",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also copy the chosen plan file to this file (folders made), e.g. plans/plan.py, "
    "the plan the docker compose stack serves.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the choice as JSON.")
def choose_command(
    frontier_dir: str,
    policy: str,
    value: float | None,
    plot: bool,
    copy_to: Path | None,
    as_json: bool,
) -> None:
    """Pick a frequency plan from a `perseus optimize` output folder DIR."""
    try:
        frontier = load_frontier(frontier_dir)
        chosen = choose_plan(frontier, policy, value)
        # --plans chosen: written now; read either way, so a broken file is not named as the plan.
        read_plan_file(ensure_plan_file(frontier, frontier.point(chosen.plan)))
        if copy_to is not None:
            copy_to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(chosen.file, copy_to)
        paths: dict[str, Path] = {}
        if plot:
            # matplotlib: only when plotting.
            from schedulers.planning.plots import plot_frontier, plot_plan_timeline

            out = Path(frontier_dir)
            paths["frontier"] = plot_frontier(out, out / FRONTIER_PNG, chosen.plan)
            paths["timeline"] = plot_plan_timeline(
                out, chosen.plan, out / timeline_png_name(chosen.plan)
            )
    except (PerseusError, OSError) as exc:
        raise _fail(exc) from None
    if as_json:
        data = asdict(chosen)
        data["file"] = str(chosen.file)
        if copy_to is not None:
            data["copied_to"] = str(copy_to)
        data.update({f"{k}_png": str(v) for k, v in paths.items()})
        click.echo(json.dumps(data, indent=2))
        return
    spec = chosen.policy + ("" if chosen.value is None else f" {chosen.value:g}")
    limit = "" if chosen.limit is None else f" (limit {chosen.limit:.4f} s)"
    click.echo(f"policy:         {spec}{limit}")
    click.echo(f"plan:           {chosen.plan}")
    click.echo(f"file:           {chosen.file}")
    if copy_to is not None:
        click.echo(f"copied to:      {copy_to}")
    click.echo(
        f"iteration time: {chosen.iteration_time:.4f} s (all-max {chosen.allmax_time:.4f} s, "
        f"{chosen.slowdown_pct:+.2f}%)"
    )
    extra = "" if chosen.energy == chosen.energy_with_p2p else f", {chosen.energy:.1f} J computing"
    click.echo(
        f"energy:         {chosen.energy_with_p2p:.1f} J per iteration{extra} "
        f"(all-max {chosen.allmax_energy:.1f} J)"
    )
    click.echo(f"saving:         {chosen.saving_j:.1f} J ({chosen.saving_pct:.2f}%) per iteration")
    click.echo(f"times:          {TIMES_NOTE}")
    if chosen.note:
        click.echo(f"note:           {chosen.note}")
    for name, path in paths.items():
        click.echo(f"{name + ' plot:':<16}{path}")
