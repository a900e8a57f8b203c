"""Where a version's time goes, step by step, inside the coordinator and the long-lived worker.

`bench_coordinator.py` prints four stamps per version from what rq and the job record keep
(task created, started, version published). This one times the steps between them: the
services run from this script (``--serve``), which wraps a few of their methods so that each
call appends ``label pid start end`` (Unix time) to a trace file, then runs ``perseus`` as
usual. The stacks are `bench_coordinator.py`'s (private Redis, 64-rank job, results shaped as
the hook sends them; `--all` adds its raw and forking stacks, taking turns version by version
as it does). Printed: the median over versions 11 and up of each step's start and end, in ms
after the first XADD of the round. The wrappers cost about 2 us a call, a few calls a version.

    python benchmarks/bench_trace.py [--versions 150] [--all]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# label -> (module, class, method): what the services' trace records.
TRACED = {
    "batch": ("coordinator.service", "Coordinator", "handle_batch"),
    "finish": ("coordinator.service", "Coordinator", "_finish"),
    "fetch": ("rq.job", "Job", "fetch"),
    "start": ("coordinator.worker_loop", "PerseusSimpleWorker", "prepare_job_execution"),
    "publish": ("protocol.store_worker", "WorkerStore", "publish"),
    "success": ("rq.worker", "BaseWorker", "handle_job_success"),
}
# (label, 0: the call's start or 1: its end, what it marks), in a version's order.
ROWS = (
    ("batch", 0, "coordinator: the round's last batch begins"),
    ("finish", 0, "coordinator: that batch's replies, enqueues and acks are sent"),
    ("fetch", 0, "worker: BLMOVE returned the task's id; rq fetches the task"),
    ("fetch", 1, "worker: task fetched and restored"),
    ("start", 0, "worker: start transaction sent (rq's writes + the first read)"),
    ("start", 1, "worker: its reply read"),
    ("advance", 0, "worker: advance_job begins"),
    ("publish", 0, "worker: publish begins (packs 64 schedules, runs the script)"),
    ("publish", 1, "worker: publish script answered"),
    ("success", 0, "worker: rq's success bookkeeping (after the version is out)"),
)


def serve(args: list[str], trace: str) -> None:
    """Run ``perseus *args`` with the traced methods wrapped (the services' entry point)."""
    import importlib

    log = open(trace, "a", buffering=1)  # kept open for the process's life
    pid = os.getpid()

    def timed(label: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*a: Any, **k: Any) -> Any:
            start = time.time()
            try:
                return fn(*a, **k)
            finally:
                # The coordinator also calls handle_batch with nothing (its periodic claim).
                if label != "batch" or a[1]:
                    log.write(f"{label} {pid} {start:.6f} {time.time():.6f}\n")

        return call

    for label, (module, cls_name, method) in TRACED.items():
        cls = getattr(importlib.import_module(module), cls_name)
        original = cls.__dict__[method]
        if isinstance(original, classmethod):
            setattr(cls, method, classmethod(timed(label, original.__func__)))
        else:
            setattr(cls, method, timed(label, original))
    tasks = importlib.import_module("coordinator.tasks")
    tasks.advance_job = timed("advance", tasks.advance_job)  # rq resolves it by name
    from coordinator.cli import main as perseus_main

    perseus_main(args, prog_name="perseus")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=150)
    parser.add_argument("--all", action="store_true", help="also the raw and forking stacks")
    parser.add_argument("--serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, os.environ["BENCH_TRACE_FILE"])
        return
    if args.versions < 11:
        parser.error("--versions must be at least 11 (the first 10 are a warm-up)")
    import bench_coordinator as bench

    with tempfile.TemporaryDirectory(prefix="perseus-trace-") as folder:
        trace = Path(folder) / "events.txt"

        def traced_perseus(url: str, *perseus_args: str) -> subprocess.Popen:
            env = dict(os.environ, PYTHONPATH=str(ROOT), BENCH_TRACE_FILE=str(trace))
            command = [sys.executable, __file__, "--serve", *perseus_args, "--redis-url", url]
            return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=None)

        bench.perseus = traced_perseus  # start_coordinator and start_worker use it
        kinds = ("raw", "long-lived", "fork") if args.all else ("long-lived",)
        rounds, serving = run_rounds(bench, kinds, args.versions)
        events = []
        for line in trace.read_text().splitlines():
            label, pid, begin, end = line.split()
            if int(pid) in serving:  # the traced stack's coordinator and worker, no other's
                events.append((label, float(begin), float(end)))
    events.sort(key=lambda e: e[1])
    marks: dict[tuple[str, int], list[float]] = defaultdict(list)
    for start, seen in rounds[10:]:
        for label, times in version_calls(events, start, seen).items():
            for which in (0, 1):
                marks[(label, which)].append((times[which] - start) * 1000)
    visible = [(seen - start) * 1000 for start, seen in rounds[10:]]
    print(f"where a version's time goes, long-lived worker, median of {len(visible)} versions")
    print(f"(ms after the round's first XADD; stacks: {', '.join(kinds)}):")
    for label, which, text in ROWS:
        values = marks.get((label, which), [])
        cell = f"{statistics.median(values):6.2f}" if values else "     -"
        print(f"  {cell}  {text}")
    print(f"  {statistics.median(visible):6.2f}  client: the version is visible")


def run_rounds(
    bench: Any, kinds: tuple[str, ...], versions: int
) -> tuple[list[tuple[float, float]], set[int]]:
    """Run the stacks' rounds; return each traced round's (first XADD, visible) and its pids."""
    stacks: list[Any] = []
    rounds: list[tuple[float, float]] = []
    try:
        for kind in kinds:
            stacks.append(bench.Stack(kind, 64, kind))
        traced = next(s for s in stacks if s.kind == "long-lived")
        for version in range(1, versions + 1):
            for stack in stacks:
                stack.round(version)
                if stack is traced:
                    # The round's first XADD on the Unix clock the services stamp with.
                    start = time.time() - (time.perf_counter() - stack.round_start)
                    rounds.append((start, start + stack.latencies[version + 1]))
                stack.settle()
        return rounds, {proc.pid for proc in traced.procs}
    finally:
        for stack in stacks:
            stack.close()


def version_calls(
    events: list[tuple[str, float, float]], start: float, seen: float
) -> dict[str, tuple[float, float]]:
    """One version's calls (label -> start, end), from the traced stack's sorted events.

    The coordinator reads several batches a round: its last one that began before the version
    was visible, and the transaction that batch sent. Of every other kind, the first call
    since the round began (the next round begins once the worker is idle again).
    """
    found: dict[str, tuple[float, float]] = {}
    finishes = []
    for label, begin, end in events:
        if label == "batch":
            if start <= begin <= seen:
                found[label] = (begin, end)
        elif label == "finish":
            finishes.append((begin, end))
        elif begin >= start and label not in found:
            found[label] = (begin, end)
    if "batch" in found:
        first, last = found["batch"]
        inside = [f for f in finishes if first <= f[0] <= last]
        if inside:
            found["finish"] = inside[-1]
    return found


if __name__ == "__main__":
    main()
