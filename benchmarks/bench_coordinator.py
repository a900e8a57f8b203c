"""Coordinator latencies and throughput on a private Redis, measured side by side in one run.

1. report -> next version: all ranks of a 64-rank job report (results shaped as the hook sends
   them: 10 iterations, 16 instructions each), then the time until the next version is visible
   to a client, for 200 versions. `perseus coordinator` and one `perseus worker` (the default,
   long-lived) or `perseus worker --fork` run as processes. The yardstick ("raw limit") is the
   same traffic served by one process with one pipeline per batch, msgpack only: no
   validation, no rq, no scheduler. The scheduler is `tests.toy_schedulers:SnapshotStepDown`,
   which lowers the clocks every round, so every round publishes a version.
   For the long-lived worker it also prints where a version's time goes, from the timestamps
   rq and the job record already keep (read between rounds, outside the timed path). For
   every row, the CPU per version of the client, the coordinator (or raw server), the worker
   and Redis, until the version is visible and until the worker is idle again (from /proc,
   read outside the timed path): against the wall time, how many cores the round kept busy.
2. Redis memory of that job (every `perseus:job:<id>:*` key) at versions 20 and 200.
3. Registrations per second from one client (request, then wait for the reply), against the
   raw request/reply limit: the same request and reply traffic (a rank's coordinates and
   clocks, a reply with a token's length), msgpack only, answered by a responder that stores
   the rank's info and answers; with the CPU each process spends per request. Several rounds,
   each with fresh processes (a round's ratio moves with where the OS runs them); the figure
   is the median round's.
4. rq round trip of a task that imports what a planning scheduler's first task needs (the
   planner and scipy.optimize, its fit): forking worker with the scheduler modules preloaded
   (the default) against `--no-preload`.

First it prints this hour's speed of the machine, to compare runs of different days: the
median round trip of a PING to a private Redis, and a pure-Python loop's time (the raw limit
has taken 2.7 to 12.3 ms; the round trip moves with it, the loop much less).

    python benchmarks/bench_coordinator.py [--versions 200] [--ranks 64]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import redis
from rq import Queue, Worker

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_cpu import Turns, cpu_seconds  # noqa: E402
from benchmarks.bench_raw_limit import RAW, raw_request, raw_server  # noqa: E402
from coordinator.embedded import EmbeddedRedis  # noqa: E402
from protocol import keys  # noqa: E402
from protocol.connection import SOCKET_TIMEOUT_S, connect  # noqa: E402
from protocol.constants import H100_GRAPHICS_CLOCKS  # noqa: E402
from protocol.models import (  # noqa: E402
    JobInfo,
    ProfilingResult,
    RankInfo,
    ReportResult,
    encode_message,
)
from worker_client.hook.session import CoordinatorClient  # noqa: E402

FREQS = list(H100_GRAPHICS_CLOCKS)
MICROBATCHES = 8  # 16 instructions per step
ITERS = 10  # the hook's default report_every
SCHEDULER = "tests.toy_schedulers:SnapshotStepDown"
WINDOWS = ((2, 21), (182, 201))


def perseus(url: str, *args: str) -> subprocess.Popen:
    """Start a `perseus` command on ``url`` (output discarded)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", *args, "--redis-url", url],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def start_worker(url: str, *flags: str) -> subprocess.Popen:
    proc = perseus(url, "worker", "--log-level", "WARNING", *flags)
    conn = redis.Redis.from_url(url)
    deadline = time.monotonic() + 60
    while not Worker.all(connection=conn) and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=20)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def hook_result(rank: int, version: int) -> ProfilingResult:
    """A result shaped like the hook's: ITERS iterations of 2 x MICROBATCHES instructions."""
    per_iter = [0.012 + 0.0001 * i for i in range(MICROBATCHES)]
    return ProfilingResult(
        rank=rank,
        schedule_version=version,
        iter_time=[0.2 + 0.001 * i for i in range(ITERS)],
        iter_energy=[140.0 + i for i in range(ITERS)],
        time_breakdown={"forward": [per_iter] * ITERS, "backward": [per_iter] * ITERS},
    )


def report_fields(
    job_id: str, ranks: int, version: int, client: CoordinatorClient | None = None
) -> list[dict]:
    """Every rank's result entry, signed with its token when ``client`` registered it."""
    return [
        encode_message(
            ReportResult(job_id=job_id, result=hook_result(rank, version)),
            token=client.token(job_id, rank) if client is not None else None,
        )
        for rank in range(ranks)
    ]


def job_memory(conn: redis.Redis, job_id: str) -> int:
    """Bytes Redis uses for every key of a job (SCAN, never KEYS)."""
    names = list(conn.scan_iter(match=f"{keys.job_key(job_id)}:*", count=1000))
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.memory_usage(name, samples=0)
        return sum(n or 0 for n in pipe.execute())


def wait_version(conn: redis.Redis, updates: str, last_id: bytes, newer_than: int) -> bytes:
    """Block on the updates stream until a version newer than ``newer_than`` is announced."""
    while True:
        reply = conn.xread({updates: last_id}, block=30_000)
        if not reply:
            raise TimeoutError(f"no version after {newer_than} within 30 s")
        for _stream, entries in reply:
            for entry_id, fields in entries:
                last_id = entry_id
                if b"version" in fields and int(fields[b"version"]) > newer_than:
                    return last_id


class Stack:
    """One private Redis with what serves it, and a job that reports on it."""

    def __init__(self, name: str, ranks: int, kind: str) -> None:
        self.name, self.ranks, self.kind = name, ranks, kind
        self.server = EmbeddedRedis()
        self.url = self.server.url
        self.conn = redis.Redis.from_url(self.url)
        self.procs: list[subprocess.Popen] = []
        self.latencies: dict[int, float] = {}
        self.memory: dict[int, int] = {}
        self.stages: list[tuple[float, ...]] = []  # long-lived only: see record_stages
        if kind == "raw":
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            script = [sys.executable, __file__, "--raw-server", self.url, "--ranks", str(ranks)]
            self.procs.append(subprocess.Popen(script, env=env))
            self.job_id, self.stream = RAW, keys.job_key(RAW, "in")
            self.client: CoordinatorClient | None = None
        else:
            self.procs.append(start_coordinator(self.url))
            self.procs.append(start_worker(self.url, *(["--fork"] if kind == "fork" else [])))
            self.client = CoordinatorClient(self.url)
            self.job_id, self.stream = register(self.client, ranks), keys.RESULTS_STREAM
        self.updates = keys.job_updates(self.job_id)
        self.last_id = wait_version(self.conn, self.updates, b"0", 0)
        # CPU seconds of (client, coordinator or raw server, worker, Redis) summed over the
        # rounds: until the version is visible, and until the worker is idle again.
        self.pids = (None, self.procs[0].pid, self.procs[-1].pid if kind != "raw" else 0)
        self.cpu_visible, self.cpu_round = [0.0] * 4, [0.0] * 4
        self.rounds_wall = [0.0, 0.0]  # the same two spans' wall time

    def cpu(self) -> list[float]:
        """CPU seconds so far of the client, coordinator (raw server), worker and Redis."""
        client, service, worker = self.pids
        return [
            cpu_seconds(client),
            cpu_seconds(service),
            cpu_seconds(worker, children=True) if worker else 0.0,
            cpu_seconds(self.server.pid),
        ]

    def add_cpu(self, total: list[float], before: list[float], wall: float, span: int) -> None:
        for i, value in enumerate(self.cpu()):
            total[i] += value - before[i]
        self.rounds_wall[span] += wall

    def round(self, version: int) -> None:
        """All ranks report ``version``; record the time until the next version is visible."""
        batch = report_fields(self.job_id, self.ranks, version, self.client)
        self.cpu_before = self.cpu()  # read before the clock starts: not in the timing
        wall, start = time.time(), time.perf_counter()
        with self.conn.pipeline(transaction=False) as pipe:
            for fields in batch:
                pipe.xadd(self.stream, fields)
            pipe.execute()
        sent = time.perf_counter() - start
        self.last_id = wait_version(self.conn, self.updates, self.last_id, version)
        self.latencies[version + 1] = time.perf_counter() - start
        self.add_cpu(self.cpu_visible, self.cpu_before, self.latencies[version + 1], 0)
        self.round_start = start
        if self.kind == "long-lived":
            self.record_stages(wall, sent, self.latencies[version + 1])
        if self.kind != "raw" and version + 1 in (20, 200):
            # The worker snapshots right after publishing: measure once it is done.
            while self.conn.exists(keys.job_lease(self.job_id)):
                time.sleep(0.005)
            self.memory[version + 1] = job_memory(self.conn, self.job_id)

    def settle(self, job_id: str | None = None) -> None:
        """Wait, outside every timing, until the worker is done with the job's last task.

        After publishing, a worker still snapshots, releases its lease and does rq's
        bookkeeping (a forked child also exits): that work must not land in the next row's
        timed round.
        """
        if self.kind != "raw":
            self._wait_idle(job_id)
        if job_id is None:  # a timed round's: its whole CPU, until the worker is idle
            wall = time.perf_counter() - self.round_start
            self.add_cpu(self.cpu_round, self.cpu_before, wall, 1)

    def _wait_idle(self, job_id: str | None) -> None:
        task = self.conn.hget(keys.job_info(job_id or self.job_id), "rq_job") or b""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done = self.conn.hget(b"rq:job:" + task, "status") in (b"finished", b"failed")
            if done and all(w.get_state() == "idle" for w in Worker.all(connection=self.conn)):
                return
            time.sleep(0.001)
        raise TimeoutError(f"{self.name}: the worker did not go idle within 30 s")

    def record_stages(self, wall: float, sent: float, visible: float) -> None:
        """Note when this round's results were in, its task created, started and published.

        Times are seconds after the first XADD: the rq task's ``created_at`` (set by the
        coordinator as it builds the task) and ``started_at`` (the worker), the job's
        ``published_at`` (Redis TIME in the publish script). One machine, one clock.
        """
        info = self.conn.hgetall(keys.job_info(self.job_id))
        task = self.conn.hgetall(b"rq:job:" + info.get(b"rq_job", b""))

        def stamp(value: bytes | None) -> float:
            if not value:
                return float("nan")
            moment = datetime.datetime.fromisoformat(value.decode().replace("Z", "+00:00"))
            return moment.timestamp() - wall

        published = float(info.get(b"published_at") or "nan") - wall
        created, started = stamp(task.get(b"created_at")), stamp(task.get(b"started_at"))
        self.stages.append((sent, created, started, published, visible))

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)
        self.server.stop()


def machine_speed(url: str) -> tuple[float, float]:
    """This hour's speed: median PING round trip (µs) to ``url``, a pure-Python loop (ms)."""
    conn = redis.Redis.from_url(url)
    trips = []
    for _ in range(2000):
        start = time.perf_counter()
        conn.ping()
        trips.append(time.perf_counter() - start)
    start, total = time.perf_counter(), 0
    for i in range(1_000_000):
        total += i * i
    loop = time.perf_counter() - start
    conn.close()
    return statistics.median(trips) * 1e6, loop * 1000


def register(client: CoordinatorClient, ranks: int) -> str:
    job_id = client.register_job(
        JobInfo(pp_degree=ranks, dp_degree=1, tp_degree=1, world_size=ranks)
    )
    for rank in range(ranks):
        client.register_rank(
            job_id,
            RankInfo(rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=FREQS),
        )
    return job_id


def start_coordinator(url: str) -> subprocess.Popen:
    args = json.dumps({"microbatches": MICROBATCHES})
    return perseus(
        url,
        "coordinator",
        "--scheduler",
        SCHEDULER,
        "--scheduler-args",
        args,
        "--log-level",
        "WARNING",
    )


def registrations(raw: Stack, ours: Stack, ranks: int, jobs: int) -> tuple[Turns, Turns]:
    """Registrations (raw limit, coordinator) from one client, interleaved job by job.

    Each side goes first every other job. The last rank of a job makes a worker compute its
    first version: that is waited for, until the worker is idle, outside both timings.
    """
    client = CoordinatorClient(ours.url)
    # Connected as CoordinatorClient connects (its reply wait, its socket time-out), through
    # redis-py's pool: a kept connection, as CoordinatorClient registers over, took less CPU
    # but more wall time per request for this raw client (h7, pinned), so the pool is the
    # stronger yardstick.
    conn = connect(raw.url, socket_timeout=client.reply_timeout + SOCKET_TIMEOUT_S)
    request = raw_request(conn, ours.job_id, FREQS)  # an id as long as a real one
    # Client, coordinator (raw server) and Redis of each side.
    turns = (
        Turns((None, raw.procs[0].pid, raw.server.pid)),
        Turns((None, ours.procs[0].pid, ours.server.pid)),
    )

    def raw_turn() -> None:
        with turns[0]:
            for rank in range(ranks + 1):
                request(rank)

    def our_turn() -> None:
        with turns[1]:
            job_id = register(client, ranks)
        wait_version(ours.conn, keys.job_updates(job_id), b"0", 0)
        ours.settle(job_id)

    for job in range(jobs):
        for turn in (raw_turn, our_turn) if job % 2 == 0 else (our_turn, raw_turn):
            turn()
    return turns


# --- the rq import round trip --------------------------------------------------------------------
def import_round_trips(url: str, rounds: int) -> list[float]:
    queue = Queue(keys.RQ_QUEUE, connection=redis.Redis.from_url(url))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        job = queue.enqueue("benchmarks.bench_tasks.import_planner")
        while job.get_status(refresh=True) not in ("finished", "failed"):
            time.sleep(0.002)
        assert job.get_status() == "finished", job.exc_info
        times.append(time.perf_counter() - start)
    return times


def window(latencies: dict[int, float], first: int, last: int) -> list[float]:
    return [latencies[v] * 1000 for v in range(first, last + 1) if v in latencies]


ROUND_STACKS = (("raw", "raw"), ("long-lived", "long-lived"))


def print_registrations(rounds: list[tuple[Turns, Turns]], ranks: int, jobs: int) -> None:
    """Rates and CPU per request over all rounds, each round's ratio, and their median."""
    count = jobs * (ranks + 1)
    ratios = sorted(raw.wall / ours.wall for raw, ours in rounds)
    total = count * len(rounds)
    print(
        f"\nregistrations per second, 1 client ({count} requests each, interleaved, "
        f"{len(rounds)} rounds of fresh processes):"
    )
    print("  CPU per request (us):                     client   server    Redis")
    for i, name in enumerate(("raw request/reply limit", "perseus coordinator")):
        wall = sum(r[i].wall for r in rounds)
        cpu = "".join(f"{sum(r[i].cpu[k] for r in rounds) / total * 1e6:9.0f}" for k in range(3))
        print(f"  {name:<24} {total / wall:8.0f}/s     {cpu}")
    # Each turn's CPU is a difference of clock ticks: off by up to a tick either way
    # (standard deviation 1/sqrt(6) of a tick), and the turns' errors add up.
    error = (jobs * len(rounds) / 6) ** 0.5 * 1e6 / os.sysconf("SC_CLK_TCK") / total
    print(f"  (CPU from /proc, in clock ticks rounded at every turn: about +-{error:.0f} us)")
    print("  each round's ratio: " + "  ".join(f"{r:.2f}" for r in ratios))
    print(f"  the coordinator reaches {statistics.median(ratios):.2f} of the limit (median round)")


def print_cpu(stacks: list[Stack], versions: int) -> None:
    """CPU per version of each row's processes, and how many cores they kept busy."""
    tick = 1 / os.sysconf("SC_CLK_TCK")
    # Each round's figure is a difference of clock ticks, off by up to a tick either way
    # (standard deviation 1/sqrt(6) of a tick); the rounds' errors add up.
    error = (versions / 6) ** 0.5 * tick / versions * 1000
    print(
        f"\nCPU per version (ms; /proc clock ticks summed over {versions} rounds: about "
        f"+-{error:.2f} ms per process):"
    )
    print(f"  {'':<40}  client   coord   worker   Redis    total    wall   cores busy")
    spans = (
        ("until the version is visible", "cpu_visible"),
        ("whole round, until the worker is idle (the client polls for that)", "cpu_round"),
    )
    for span, (title, attr) in enumerate(spans):
        print(f"  {title}:")
        for stack in stacks:
            if stack.kind == "fork" and span == 0:
                continue  # a forked task's CPU is counted when it exits, after this span
            cpu = [c / versions * 1000 for c in getattr(stack, attr)]
            wall = stack.rounds_wall[span] / versions * 1000
            cells = "".join(f"{c:8.2f}" for c in cpu) + f" {sum(cpu):8.2f} {wall:7.2f}"
            print(f"    {stack.name:<38}{cells}   {sum(cpu) / wall:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--registration-jobs", type=int, default=32)
    parser.add_argument("--registration-rounds", type=int, default=5)
    parser.add_argument("--raw-server", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_server:
        raw_server(args.raw_server, args.ranks, FREQS, MICROBATCHES)
        return
    last = args.versions + 1
    windows = [(a, min(b, last)) for a, b in WINDOWS if a <= last]
    print(
        f"coordinator benchmark: python {sys.version.split()[0]}, {os.cpu_count()} cores, "
        f"{args.ranks} ranks, {args.versions} versions; each row has its own private Redis, "
        "and the rows take turns version by version"
    )
    stacks: list[Stack] = []
    try:
        for name, kind in (
            ("raw limit (one process, msgpack only)", "raw"),
            ("perseus worker (long-lived, default)", "long-lived"),
            ("perseus worker --fork", "fork"),
        ):
            stacks.append(Stack(name, args.ranks, kind))
        ping_us, loop_ms = machine_speed(stacks[0].url)
        print(
            f"this hour's machine: PING round trip {ping_us:.0f} us (median of 2000), "
            f"a pure-Python loop of 1e6 steps {loop_ms:.0f} ms"
        )
        for version in range(1, args.versions + 1):
            for stack in stacks:
                stack.round(version)
                stack.settle()
        print(f"\nreport -> next version visible, {args.ranks} ranks (ms):")
        header = "".join(f"   v{a}-{b} p50    p99" for a, b in windows)
        print(f"  {'':<40}{header}   p50 growth")
        for stack in stacks:
            cells, medians = "", []
            for a, b in windows:
                values = window(stack.latencies, a, b)
                medians.append(statistics.median(values))
                cells += f"  {medians[-1]:10.1f} {percentile(values, 0.99):7.1f}"
            growth = f"{medians[-1] / medians[0]:.2f}x" if len(medians) > 1 else "-"
            print(f"  {stack.name:<40}{cells}   {growth}")
        print_cpu(stacks, args.versions)
        stages = [row for row in stacks[1].stages[1:] if all(t == t for t in row)]
        print(f"\nwhere the time goes, long-lived worker, p50 of {len(stages)} versions (ms after")
        print("the first XADD; rq's and the job's own timestamps):")
        names = (
            "all results in Redis (client's pipeline answered)",
            "rq task created (coordinator read, checked, stored them)",
            "rq task started (worker dequeued and recorded it)",
            "version published (state read, scheduler, publish script)",
            "version visible to the client",
        )
        for i, name in enumerate(names):
            print(f"  {name:<62}{statistics.median(row[i] for row in stages) * 1000:6.1f}")
        print("\nRedis memory of the job (every perseus:job:<id>:* key):")
        for stack in stacks:
            if stack.memory:
                memory = stack.memory
                cells = "   ".join(f"v{v}: {b / 1e3:7.1f} kB" for v, b in sorted(memory.items()))
                ratio = f"   v200/v20 {memory[200] / memory[20]:.2f}" if len(memory) == 2 else ""
                print(f"  {stack.name:<40}{cells}{ratio}")
        rounds = [registrations(stacks[0], stacks[1], args.ranks, args.registration_jobs)]
        for stack in stacks:
            stack.close()
        stacks = []
        for _ in range(args.registration_rounds - 1):
            # Fresh processes each round: how the OS places three busy processes on few
            # cores moves a round's ratio more than anything measured here.
            stacks = [Stack(name, args.ranks, kind) for name, kind in ROUND_STACKS]
            rounds.append(registrations(stacks[0], stacks[1], args.ranks, args.registration_jobs))
            for stack in stacks:
                stack.close()
            stacks = []
        print_registrations(rounds, args.ranks, args.registration_jobs)
    finally:
        for stack in stacks:
            stack.close()

    print("\nrq round trip of a task importing the planner and its fit (scipy.optimize), --fork:")
    with EmbeddedRedis() as server:
        results = {}
        for name, flags in (
            ("schedulers preloaded", ("--fork",)),
            ("--no-preload", ("--fork", "--no-preload")),
        ):
            worker = start_worker(server.url, *flags)
            try:
                results[name] = [t * 1000 for t in import_round_trips(server.url, 10)]
            finally:
                stop(worker)
            values = results[name]
            median, p90 = statistics.median(values), percentile(values, 0.9)
            print(f"  {name:<24} median {median:7.1f} ms   p90 {p90:7.1f} ms")
        fast, slow = (statistics.median(v) for v in results.values())
        print(f"  without preloading such a task takes {slow / fast:.1f}x as long")


if __name__ == "__main__":
    main()
