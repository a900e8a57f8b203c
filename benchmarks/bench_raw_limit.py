"""The raw limit of benchmarks/bench_coordinator.py: its traffic served by msgpack alone.

One process, one pipeline per batch: no validation, no rq, no scheduler. The yardstick the
coordinator's latencies and registration rates are measured against.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import msgpack
import redis

from protocol import keys
from protocol.connection import connect

RAW = "bench-raw"  # job id of the raw limit's keys (built with protocol.keys like the rest)


def raw_server(url: str, ranks: int, freqs: list[int], microbatches: int) -> None:
    """One process, one pipeline per batch, msgpack only: answers requests, publishes versions.

    Each version's schedules step down ``freqs`` and hold ``microbatches`` forward and
    backward instructions, as the benchmark's scheduler's do.

    It stores what the coordinator stores (each rank's info, each result) and connects as it
    does (``protocol.connection.connect``: the same socket time-outs, one dedicated connection).
    """
    conn = connect(url, dedicated=True)
    results, requests = keys.job_key(RAW, "in"), keys.job_key(RAW, "requests")
    for stream in (results, requests):
        try:
            conn.xgroup_create(stream, "raw", id="0", mkstream=True)
        except redis.ResponseError:
            pass
    version = 1
    counts: dict[int, int] = {}  # version -> results received
    conn.set(keys.job_version(RAW), version)
    conn.xadd(keys.job_updates(RAW), {"version": version})
    while True:
        reply = conn.xreadgroup("raw", "raw", {results: ">", requests: ">"}, count=100, block=1000)
        with conn.pipeline(transaction=False) as pipe:
            for stream, entries in reply or []:
                for entry_id, fields in entries:
                    data = msgpack.unpackb(fields[b"data"], raw=False)
                    if stream.decode() == requests:
                        rank_info = data["rank_info"]
                        pipe.hset(
                            keys.job_ranks(RAW), str(rank_info["rank"]), msgpack.packb(rank_info)
                        )
                        reply_key = keys.reply_key(data["request_id"])
                        reply = dict(RAW_REPLY, job_id=data["job_id"])
                        pipe.lpush(reply_key, msgpack.packb(reply))
                        pipe.expire(reply_key, 300)
                    else:
                        result = data["result"]
                        v = result["schedule_version"]
                        pipe.hset(
                            keys.job_results(RAW, v), str(result["rank"]), msgpack.packb(result)
                        )
                        counts[v] = counts.get(v, 0) + 1
                    pipe.xack(stream, "raw", entry_id)
            if counts.get(version, 0) >= ranks:
                version += 1
                freq = freqs[min(version, len(freqs) - 1)]
                names = ["forward", "backward"] * microbatches
                for rank in range(ranks):
                    schedule = {
                        "rank": rank,
                        "version": version,
                        "frequencies": [[n, freq] for n in names],
                    }
                    pipe.hset(keys.job_schedule(RAW, version), str(rank), msgpack.packb(schedule))
                pipe.set(keys.job_version(RAW), version)
                pipe.xadd(keys.job_updates(RAW), {"version": version})
            pipe.execute()


# The raw server's answer: the fields and sizes of a registration reply (a 43-character token
# like protocol.tokens makes), none of the work.
RAW_REPLY = {"ok": True, "job_id": RAW, "error": "", "instruction_energy": False, "token": "t" * 43}


def raw_request(conn: redis.Redis, job_id: str, freqs: list[int]) -> Callable[[int], None]:
    """The client side of the raw limit: the same request/reply traffic as CoordinatorClient.

    The request carries what a rank's registration carries (a job id as long as a real one,
    the rank's coordinates and clocks ``freqs``), packed with msgpack alone: no models, no
    validation.
    """
    stream = keys.job_key(RAW, "requests")

    def request(rank: int) -> None:
        request_id = uuid.uuid4().hex
        message = {
            "kind": "register_rank",
            "request_id": request_id,
            "job_id": job_id,
            "rank_info": {
                "rank": rank,
                "dp_rank": 0,
                "pp_rank": rank,
                "tp_rank": 0,
                "available_frequencies": freqs,
            },
        }
        fields = {"kind": "register_rank", "data": msgpack.packb(message), "job_id": job_id}
        conn.xadd(stream, fields)
        if conn.blpop([keys.reply_key(request_id)], timeout=30) is None:
            raise TimeoutError("raw server did not answer")

    return request
