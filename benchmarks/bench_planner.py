"""Planner wall time, peak memory and energy saving on synthetic imbalanced profiles.

Each pipeline size runs in its own subprocess, so that peak RSS (``ru_maxrss``) belongs to that
size alone. The profile is :mod:`schedulers.planning.synthetic_profile` (H100-like clocks, every
``--stride``-th one; imbalanced stages; backward ~2x forward; energy minimum inside the clock
range). Every figure printed is measured on this machine; nothing is hard-coded.

    python benchmarks/bench_planner.py                        # 4x8, 8x16, 8x32
    python benchmarks/bench_planner.py --sizes 4x8 --tracemalloc
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rss_mb() -> float:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one(stages: int, micro: int, stride: int, unit: float, trace: bool) -> dict:
    """Plan one size in this process and return the measurements."""
    sys.path.insert(0, str(ROOT))
    t0 = time.perf_counter()
    import lowtime.solver  # noqa: F401  (measured separately: ~1 s of imports)

    from schedulers.planning.choose import choose_plan
    from schedulers.planning.planner import plan_frontier
    from schedulers.planning.synthetic_profile import synthetic_profile

    import_s = time.perf_counter() - t0
    profile = synthetic_profile(stages, stride=stride)
    base_rss = _rss_mb()
    if trace:
        import tracemalloc

        tracemalloc.start()
    with tempfile.TemporaryDirectory(prefix="bench-planner-") as out:
        t0 = time.perf_counter()
        result = plan_frontier(profile, stages, micro, out_dir=out, unit_time=unit)
        wall = time.perf_counter() - t0
        py_peak = None
        if trace:
            import tracemalloc

            py_peak = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
        best = choose_plan(out, "no-slowdown")
        least = choose_plan(out, "min-energy")
        files_mb = sum(p.stat().st_size for p in Path(out).iterdir()) / 2**20
    return {
        "size": f"{stages}x{micro}",
        "instructions": 2 * stages * micro,
        "clocks": len(profile.frequencies(0, "forward")),
        "plans": len(result.points),
        "import_s": import_s,
        "wall_s": wall,
        "solve_s": result.meta["timings"]["solve_s"],
        "base_rss_mb": base_rss,
        "peak_rss_mb": _rss_mb(),
        "py_peak_mb": py_peak,
        "files_mb": files_mb,
        "allmax_time": result.allmax.iteration_time,
        "allmax_energy": result.allmax.energy_with_p2p,
        "nos_plan": best.plan,
        "nos_time": best.iteration_time,
        "nos_saving_pct": best.saving_pct,
        "min_saving_pct": least.saving_pct,
        "min_slowdown_pct": least.slowdown_pct,
        "rounding_bound": result.rounding_bound,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4x8,8x16,8x32", help="STAGESxMICROBATCHES,...")
    parser.add_argument("--stride", type=int, default=4, help="keep every n-th H100 clock")
    parser.add_argument("--unit-time", type=float, default=0.001)
    parser.add_argument("--tracemalloc", action="store_true", help="also peak Python heap (slower)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # Child mode: one size, JSON out.
    args = parser.parse_args()
    if args.one:
        s, m = (int(x) for x in args.one.split("x"))
        print(json.dumps(run_one(s, m, args.stride, args.unit_time, args.tracemalloc)))
        return

    rows = []
    for size in args.sizes.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--one",
            size,
            "--stride",
            str(args.stride),
            "--unit-time",
            str(args.unit_time),
        ]
        if args.tracemalloc:
            cmd.append("--tracemalloc")
        print(f"planning {size} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"{size} failed:\n{proc.stderr}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))

    print(
        f"\nplanner benchmark: synthetic imbalanced profile, every {args.stride}th H100 clock, "
        f"unit time {args.unit_time:g} s; python {sys.version.split()[0]}"
    )
    head = (
        f"{'size':>5} {'instr':>5} {'clk':>3} {'plans':>5} {'wall s':>7} {'solve s':>7} "
        f"{'RSS MB':>6} {'+plan':>6} {'heap MB':>7} {'files':>6} {'all-max s':>9} "
        f"{'no-slowdown':>11} {'saving':>7} {'min-E saving':>12} {'(slower)':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        heap = f"{r['py_peak_mb']:.0f}" if r["py_peak_mb"] is not None else "-"
        print(
            f"{r['size']:>5} {r['instructions']:>5} {r['clocks']:>3} {r['plans']:>5} "
            f"{r['wall_s']:>7.1f} {r['solve_s']:>7.1f} {r['peak_rss_mb']:>6.0f} "
            f"{r['peak_rss_mb'] - r['base_rss_mb']:>6.0f} {heap:>7} {r['files_mb']:>5.1f}M "
            f"{r['allmax_time']:>9.3f} {r['nos_time']:>10.3f}s {r['nos_saving_pct']:>6.1f}% "
            f"{r['min_saving_pct']:>11.1f}% {r['min_slowdown_pct']:>+7.1f}%"
        )
    print(
        "\nwall s: plan_frontier (fit + DAG + solver + writing every plan); solve s: solver loop "
        "incl. writing plans; RSS MB: peak resident set of the child; +plan: growth during "
        "planning; heap MB: tracemalloc peak (--tracemalloc); files: output folder size; "
        "saving: energy vs all-max clocks at no slowdown / at minimum energy."
    )


if __name__ == "__main__":
    main()
