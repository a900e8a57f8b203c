"""perseus-mq over TLS (``rediss://``): hook, coordinator, worker and CLI, certificate checked."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.embedded import EmbeddedRedis
from protocol.connection import connect
from protocol.exceptions import CoordinatorUnavailableError
from tests.helpers import TOY_SCHEDULER, free_ports, start_perseus, stop
from tests.rank_helpers import make_hook, step_until
from tests.tls_proxy import TLSProxy, self_signed_cert
from worker_client.gpu.frequency import DryRunFrequencyController

PASSWORD = "tls-pw-2468"


@pytest.fixture
def tls_url(tmp_path) -> Iterator[tuple[str, str]]:
    """(URL that trusts the server's certificate, URL that does not) of a TLS-only Redis."""
    cert, key = self_signed_cert(tmp_path)
    port = free_ports()[0]
    with EmbeddedRedis(password=PASSWORD) as server:
        proxy = TLSProxy(port, server.socket_path, cert, key)
        proxy.start()
        proxy.ready.wait(10)
        base = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0"
        yield f"{base}?ssl_ca_certs={cert}", base
        proxy.stop()


def test_the_whole_loop_runs_over_tls(tls_url, gloo, tmp_path, monkeypatch):
    url, _ = tls_url
    monkeypatch.setenv("PERSEUS_SIM_GPU_DIR", str(tmp_path / "simgpu"))
    assert connect(url, ping=True).ping()
    services = [
        start_perseus(
            ["coordinator", "--redis-url", url, "--scheduler", TOY_SCHEDULER], tmp_path, "c.log"
        ),
        start_perseus(["worker", "--redis-url", url], tmp_path, "w.log"),
    ]
    try:
        hook = make_hook(url, DryRunFrequencyController(0), report_every=1)
        try:
            step_until(hook, lambda: hook.schedule.version >= 3, 60, "version 3 over TLS")
            job_id = hook.job_id
        finally:
            hook.close()
        result = CliRunner().invoke(main, ["status", "--redis-url", url])
        assert result.exit_code == 0 and job_id in result.output
    finally:
        stop(services)
    started = (tmp_path / "c.log").read_text()
    assert "redis=rediss://:***@127.0.0.1:" in started and PASSWORD not in started


def test_an_untrusted_certificate_is_refused_with_a_clear_error(tls_url):
    _, untrusted = tls_url
    with pytest.raises(CoordinatorUnavailableError, match="certificate verify failed") as caught:
        connect(untrusted, ping=True)
    assert PASSWORD not in str(caught.value) and "rediss://:***@127.0.0.1" in str(caught.value)
    result = CliRunner().invoke(main, ["status", "--redis-url", untrusted])
    assert result.exit_code == 1 and "certificate verify failed" in result.output
    assert PASSWORD not in result.output


def test_plain_text_to_a_tls_port_hints_at_rediss(tls_url):
    trusted, _ = tls_url
    plain = trusted.split("?")[0].replace("rediss://", "redis://", 1)
    with pytest.raises(CoordinatorUnavailableError, match="use rediss:// for TLS"):
        connect(plain, ping=True)


def test_rediss_to_a_plain_text_port_fails_within_the_connect_timeout():
    port = free_ports()[0]
    with EmbeddedRedis(port=port):
        started = time.monotonic()
        with pytest.raises(CoordinatorUnavailableError, match="does this port speak TLS"):
            connect(f"rediss://127.0.0.1:{port}/0", ping=True, connect_timeout=1.0)
        # redis-py alone waits for the handshake as long as for any reply (30 s here).
        assert time.monotonic() - started < 10
