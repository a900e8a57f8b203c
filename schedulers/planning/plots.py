"""Pictures of a frontier and of a plan's pipeline timeline (PNG, no display needed).

Figures are drawn with matplotlib's object API on an Agg canvas, so nothing here touches
pyplot's global backend or state (safe in workers and tests). lowtime's own visualizer is not
used: it does not import with matplotlib 3.11.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from protocol.exceptions import ConfigError
from protocol.pipeline_schedules import PIPELINE_SCHEDULES, schedules_matching
from schedulers.planning.choose import choose_plan
from schedulers.planning.frontier_files import (
    FRONTIER_PNG,
    PROFILE_CSV,
    Frontier,
    load_frontier,
    timeline_png_name,
)
from schedulers.planning.frontier_plans import ensure_plan_file
from schedulers.planning.pipeline_dag import PipelineShape
from schedulers.planning.plan_file import read_plan_file
from schedulers.planning.profile_csv import ProfileTable, read_profile_csv


def _save(fig: Figure, out_path: str | Path) -> Path:
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120)
    return path


def plot_frontier(
    frontier: Frontier | str | Path, out_path: str | Path, chosen: str | None = None
) -> Path:
    """Draw iteration time against energy for every plan, with all-max and a chosen plan.

    Args:
        frontier: A planner output folder or a loaded Frontier.
        out_path: PNG to write.
        chosen: Plan id to highlight, if any.

    Returns:
        The PNG's path.

    """
    fr = frontier if isinstance(frontier, Frontier) else load_frontier(frontier)
    pts = sorted(fr.pareto, key=lambda p: p.iteration_time)
    dominated = [p for p in fr.points if p.dominated]
    with_p2p = any(p.energy_with_p2p != p.energy for p in [*fr.points, fr.allmax])
    fig = Figure(figsize=(7.5, 5.0))
    ax = fig.add_subplot()
    label = "Pareto-optimal plans" + (" (incl. P2P blocking)" if with_p2p else "")
    ax.plot(
        [p.iteration_time for p in pts],
        [p.energy_with_p2p for p in pts],
        ".-",
        color="tab:blue",
        markersize=3,
        linewidth=1,
        label=label,
    )
    if dominated:
        ax.plot(
            [p.iteration_time for p in dominated],
            [p.energy_with_p2p for p in dominated],
            ".",
            color="tab:gray",
            markersize=2,
            label=f"dominated plans ({len(dominated)})",
        )
    if with_p2p:
        ax.plot(
            [p.iteration_time for p in pts],
            [p.energy for p in pts],
            "--",
            color="tab:gray",
            linewidth=1,
            label="Pareto-optimal plans (computation only)",
        )
    ref = fr.allmax
    ax.plot(
        [ref.iteration_time],
        [ref.energy_with_p2p],
        "*",
        color="tab:red",
        markersize=14,
        label=f"all-max clocks ({ref.iteration_time:.4f} s, {ref.energy_with_p2p:.1f} J)",
    )
    if chosen is not None:
        p = fr.point(chosen)
        saving = 100.0 * (1.0 - p.energy_with_p2p / ref.energy_with_p2p)
        ax.plot(
            [p.iteration_time],
            [p.energy_with_p2p],
            "o",
            markersize=11,
            markerfacecolor="none",
            markeredgecolor="tab:green",
            markeredgewidth=2,
            label=f"plan {p.plan} ({p.iteration_time:.4f} s, {saving:.1f}% less energy)",
        )
    stages = fr.meta.get("num_stages", "?")
    micro = fr.meta.get("num_microbatches", "?")
    ax.set_title(
        f"Time-energy frontier: {stages} stages x {micro} microbatches, "
        f"{len(pts)} Pareto-optimal plans"
    )
    ax.set_xlabel("iteration time (s)")
    ax.set_ylabel("energy per iteration (J)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return _save(fig, out_path)


def plot_timeline(
    stages: Sequence[Sequence[tuple[str, int]]],
    table: ProfileTable,
    out_path: str | Path,
    title: str = "",
) -> Path:
    """Draw a plan's timeline (1F1B or GPipe): one row per stage, bars coloured by clock.

    Bars start as soon as the stage is free and the instruction's input has arrived (previous
    stage's forward, next stage's backward); durations are the profile's times at the plan's
    clocks. Communication time is not modelled.

    Args:
        stages: ``stages[s]``: ``(instruction, MHz)`` pairs of stage ``s`` in execution order.
        table: ``table[(stage, instruction)][MHz] = (time, energy)``.
        out_path: PNG to write.
        title: Figure title.

    Returns:
        The PNG's path.

    Raises:
        ConfigError: The plan follows no supported schedule or uses a clock the profile lacks.

    """
    num_stages = len(stages)
    num_micro = sum(1 for name, _ in stages[0] if name == "forward") if stages else 0
    matching = schedules_matching([[name for name, _ in stage] for stage in stages])
    if not matching:
        raise ConfigError(
            f"the plan follows none of the supported orders ({', '.join(PIPELINE_SCHEDULES)})"
        )
    shape = PipelineShape(num_stages, num_micro, matching[0])
    freqs: list[int] = []
    durations: list[float] = []
    for s, stage in enumerate(stages):
        for name, freq in stage:
            entry = table.get((s, name), {})
            if freq not in entry:
                raise ConfigError(f"the profile has no stage {s} {name} at {freq} MHz")
            freqs.append(freq)
            durations.append(entry[freq][0])
    start, finish = shape.schedule(durations)
    norm = Normalize(
        vmin=min(freqs), vmax=max(freqs) if max(freqs) > min(freqs) else min(freqs) + 1
    )
    cmap = colormaps["viridis"]
    fig = Figure(figsize=(max(8.0, min(24.0, 0.25 * len(stages[0]) + 4)), 1.0 + 0.6 * num_stages))
    ax = fig.add_subplot()
    ax.barh(
        [s for s, _, _ in shape.nodes],
        durations,
        left=start,
        height=0.8,
        color=[cmap(norm(f)) for f in freqs],
        edgecolor="black",
        linewidth=0.4,
    )
    span = max(finish)
    for i, (s, name, m) in enumerate(shape.nodes):
        if durations[i] > span / 60:  # Label only bars wide enough to read.
            text = f"{'F' if name == 'forward' else 'B'}{m}"
            color = "white" if norm(freqs[i]) < 0.5 else "black"
            ax.text(
                start[i] + durations[i] / 2,
                s,
                text,
                ha="center",
                va="center",
                fontsize=6,
                color=color,
            )
    ax.set_yticks(range(num_stages), [f"stage {s}" for s in range(num_stages)])
    ax.invert_yaxis()
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("time (s)")
    ax.set_title(title or f"{shape.schedule_name} timeline: iteration {span:.4f} s")
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="GPU clock (MHz)")
    fig.tight_layout()
    return _save(fig, out_path)


def plot_plan_timeline(frontier_dir: str | Path, plan: str, out_path: str | Path) -> Path:
    """Draw the timeline of one plan of a planner output folder (uses its ``profile.csv``)."""
    fr = load_frontier(frontier_dir)
    point = fr.point(plan)
    if not point.file:
        raise ConfigError(f"plan {plan!r} has no plan file")
    profile = read_profile_csv(fr.out_dir / PROFILE_CSV)
    plan_file = read_plan_file(ensure_plan_file(fr, point))
    title = (
        f"Plan {point.plan}: {point.iteration_time:.4f} s, "
        f"{point.energy_with_p2p:.1f} J per iteration"
    )
    return plot_timeline(plan_file.stages, profile.table, out_path, title)


def plot_run(frontier_dir: str | Path, chosen: str | None = None) -> dict[str, Path]:
    """Draw a planner folder's frontier and one plan's timeline into the folder.

    Args:
        frontier_dir: A planner output folder.
        chosen: Plan to mark and draw; default the no-slowdown plan.

    Returns:
        ``{"frontier": path, "timeline": path}``.

    """
    fr = load_frontier(frontier_dir)
    plan = chosen if chosen is not None else choose_plan(fr, "no-slowdown").plan
    plan = fr.point(plan).plan
    return {
        "frontier": plot_frontier(fr, fr.out_dir / FRONTIER_PNG, chosen=plan),
        "timeline": plot_plan_timeline(fr.out_dir, plan, fr.out_dir / timeline_png_name(plan)),
    }
