"""Planner solvers side by side: lowtime 0.3 vs the pure-Python core vs the C kernel.

Every (size, solver) runs ``plan_frontier`` in its own subprocess, so that peak RSS
(``ru_maxrss``) belongs to that run alone; the parent then checks that every solver of a size
produced the same frontier (number of plans, quantized times, model energy within 1e-9) and
prints wall time, solver time, peak RSS and the speed-up over lowtime measured in the same run.
The profile is :mod:`schedulers.planning.synthetic_profile` (H100-like clocks, every
``--stride``-th one; imbalanced stages). Nothing is hard-coded: every figure is measured here.

It also times what a ``perseus target`` costs an rq worker with ``FrontierScheduler`` planning
from a profile: rebuild the scheduler (fit + plan in memory) and serve the new target's plan.

    python benchmarks/bench_planner.py                       # the full table (~10 min)
    python benchmarks/bench_planner.py --no-lowtime-16x32    # skip lowtime's ~130 s run
    python benchmarks/bench_planner.py --sizes 4x8,8x16 --solvers lowtime,native
"""

from __future__ import annotations

import argparse
import csv
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SIZES = "4x8,8x16,8x32,16x32,16x64,32x128"
LOWTIME_MAX = 16 * 32  # lowtime runs up to 16x32 (its cost grows as N^2).


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB.


def run_one(size: str, solver: str, stride: int, unit: float, plans: str, out: str) -> dict:
    """Plan one size with one solver in this process; return the measurements."""
    sys.path.insert(0, str(ROOT))
    stages, micro = (int(x) for x in size.split("x"))
    t0 = time.perf_counter()
    import scipy.optimize  # noqa: F401  (the cost-model fit; a worker preloads it)

    if solver == "lowtime":
        import lowtime.solver  # noqa: F401  (~1 s of imports, measured with the others)
    from schedulers.planning.planner import plan_frontier
    from schedulers.planning.synthetic_profile import synthetic_profile

    import_s = time.perf_counter() - t0
    profile = synthetic_profile(stages, stride=stride)
    t0 = time.perf_counter()
    result = plan_frontier(
        profile, stages, micro, out_dir=out, unit_time=unit, solver=solver, plans=plans
    )
    wall = time.perf_counter() - t0
    files_mb = sum(p.stat().st_size for p in Path(out).iterdir()) / 2**20
    from schedulers.planning.choose import choose_plan

    saving = choose_plan(out, "no-slowdown").saving_pct
    return {
        "size": size,
        "solver": result.meta["solver"],
        "plans_mode": plans,
        "instructions": 2 * stages * micro,
        "plans": len(result.points),
        "import_s": import_s,
        "wall_s": wall,
        "fit_s": result.meta["timings"]["fit_s"],
        "solve_s": result.meta["timings"]["solve_s"],
        "write_s": result.meta["timings"]["write_s"],
        "peak_rss_mb": _rss_mb(),
        "files_mb": files_mb,
        "saving_pct": saving,
    }


def run_replan(size: str, stride: int, unit: float, folder: str) -> dict:
    """Time an rq worker's rebuild of a profile-planning FrontierScheduler plus a target."""
    sys.path.insert(0, str(ROOT))
    stages, micro = (int(x) for x in size.split("x"))
    import scipy.optimize  # noqa: F401  (`perseus worker` preloads it before forking)

    from protocol.constants import H100_GRAPHICS_CLOCKS
    from protocol.models import JobInfo, RankInfo
    from schedulers.frontier import FrontierScheduler
    from schedulers.planning.synthetic_profile import write_synthetic_profile

    profile = write_synthetic_profile(Path(folder) / "profile.csv", stages, stride=stride)
    job = JobInfo(pp_degree=stages, dp_degree=1, tp_degree=1, world_size=stages)
    ranks = [
        RankInfo(
            rank=r,
            dp_rank=0,
            pp_rank=r,
            tp_rank=0,
            available_frequencies=list(H100_GRAPHICS_CLOCKS),
        )
        for r in range(stages)
    ]
    args = {"profile": str(profile), "microbatches": micro, "unit_time": unit}
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        sched = FrontierScheduler(job, ranks, **args)
        fastest = sched.frontier.points[-1].iteration_time
        sched.set_target(fastest * 1.2)
        sched.next_schedule()
        times.append(time.perf_counter() - t0)
    return {"size": size, "replan_s": min(times), "solver": sched._computed.solver}  # type: ignore[union-attr]


def _frontier(out: str) -> list[tuple[int, float]]:
    with open(Path(out) / "frontier.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["plan"] != "allmax"]
    return [(int(r["quant_time"]), float(r["model_cost"])) for r in rows]


def _same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    return len(a) == len(b) and all(
        qa == qb and abs(ca - cb) <= 1e-9 * abs(cb) for (qa, ca), (qb, cb) in zip(a, b, strict=True)
    )


def _child(args: list[str]) -> dict:
    cmd = [sys.executable, __file__, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="STAGESxMICROBATCHES,...")
    parser.add_argument("--solvers", default="lowtime,python,native")
    parser.add_argument("--stride", type=int, default=4, help="keep every n-th H100 clock")
    parser.add_argument("--unit-time", type=float, default=0.001)
    parser.add_argument(
        "--chosen-sizes",
        default="32x128",
        help="sizes planned with --plans chosen (frontier.csv, plans.delta and 2 plan files)",
    )
    parser.add_argument("--no-lowtime-16x32", action="store_true", help="skip lowtime's ~130 s")
    parser.add_argument("--replan-size", default="8x32", help="FrontierScheduler target timing")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # Child: size solver plans.
    parser.add_argument("--replan", help=argparse.SUPPRESS)  # Child: replan timing.
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        size, solver, plans = args.one
        print(json.dumps(run_one(size, solver, args.stride, args.unit_time, plans, args.out)))
        return
    if args.replan:
        print(json.dumps(run_replan(args.replan, args.stride, args.unit_time, args.out)))
        return

    common = ["--stride", str(args.stride), "--unit-time", str(args.unit_time)]
    chosen = set(args.chosen_sizes.split(",")) if args.chosen_sizes else set()
    rows: list[dict] = []
    agree: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-planner-") as tmp:
        for size in args.sizes.split(","):
            s, m = (int(x) for x in size.split("x"))
            ref: list[tuple[int, float]] | None = None
            verdicts = []
            for solver in args.solvers.split(","):
                if solver == "lowtime" and (
                    s * m > LOWTIME_MAX or (size == "16x32" and args.no_lowtime_16x32)
                ):
                    continue
                out = str(Path(tmp) / f"{size}-{solver}")
                plans = "chosen" if size in chosen else "all"
                print(f"planning {size} with {solver} ...", file=sys.stderr, flush=True)
                rows.append(_child(["--one", size, solver, plans, "--out", out, *common]))
                got = _frontier(out)
                if ref is None:
                    ref = got
                else:
                    verdicts.append("same" if _same(ref, got) else "DIFFERENT")
                subprocess.run(["rm", "-rf", out], check=True)
            agree[size] = ", ".join(verdicts) if verdicts else "-"
        replan = None
        if args.replan_size:
            print(f"replanning {args.replan_size} ...", file=sys.stderr, flush=True)
            replan = _child(["--replan", args.replan_size, "--out", tmp, *common])

    print(
        f"\nplanner solvers: synthetic imbalanced profile, every {args.stride}th H100 clock, "
        f"unit time {args.unit_time:g} s; python {sys.version.split()[0]}"
    )
    head = (
        f"{'size':>6} {'instr':>5} {'solver':>7} {'plans':>5} {'files':>6} {'wall s':>8} "
        f"{'solve s':>8} {'fit s':>5} {'write s':>7} {'RSS MB':>6} {'x lowtime':>9} "
        f"{'(solve)':>8} {'saving':>6}"
    )
    print(head)
    print("-" * len(head))
    lowtime = {r["size"]: r for r in rows if r["solver"] == "lowtime"}
    for r in rows:
        ref_row = lowtime.get(r["size"])
        ratio = f"{ref_row['wall_s'] / r['wall_s']:.0f}x" if ref_row else "-"
        ratio_solve = f"{ref_row['solve_s'] / r['solve_s']:.0f}x" if ref_row else "-"
        files = "all" if r["plans_mode"] == "all" else "chosen"
        print(
            f"{r['size']:>6} {r['instructions']:>5} {r['solver']:>7} {r['plans']:>5} "
            f"{files:>6} {r['wall_s']:>8.2f} {r['solve_s']:>8.3f} {r['fit_s']:>5.2f} "
            f"{r['write_s']:>7.2f} {r['peak_rss_mb']:>6.0f} {ratio:>9} {ratio_solve:>8} "
            f"{r['saving_pct']:>5.1f}%"
        )
    print("\nsame frontier as the first solver of each size (count, times, model energy):")
    for size, verdict in agree.items():
        print(f"  {size}: {verdict}")
    if replan:
        print(
            f"\nperseus target on a running {replan['size']} job (FrontierScheduler from a "
            f"profile, {replan['solver']}): rebuild + plan + new target in "
            f"{replan['replan_s']:.3f} s (best of 3, scipy preloaded as by perseus worker)"
        )
    print(
        "\nwall s: plan_frontier end to end (fit, solve, plan files, frontier.csv); solve s: the "
        "solver alone; files: every plan file, or only the no-slowdown and min-energy ones "
        "(plans.delta holds the rest); RSS MB: peak resident set of the child process; "
        "x lowtime: lowtime's time / this solver's, same size, same run; saving: energy saved "
        "at no slowdown vs all-max clocks."
    )


if __name__ == "__main__":
    main()
