"""A TCP proxy in front of a real Redis that can go silent, as a network dropping packets does.

A Redis that is down refuses connections at once; a network that silently drops packets does
not: connections stay open, writes succeed, and no reply ever comes, so a client waits until
its socket time-out. :class:`SilentProxy` plays that network in tests, with a real Redis
behind it (no mock of Redis).
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType
from urllib.parse import urlsplit


class SilentProxy:
    """Forwards a port of 127.0.0.1 to a Redis until told to go silent.

    Once silent, every byte either way is read and dropped: clients' connections (old and
    new) stay open and their writes succeed, but nothing reaches Redis and no reply comes.

    Args:
        redis_url: The Redis to forward to (``unix://`` or ``redis://host:port``).
    """

    def __init__(self, redis_url: str) -> None:
        parts = urlsplit(redis_url)
        if parts.scheme == "unix":
            self._family, self._address = socket.AF_UNIX, parts.path
        else:
            self._family, self._address = socket.AF_INET, (parts.hostname, parts.port or 6379)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"
        self._marker: bytes | None = None
        self.silent = threading.Event()
        self.dropped = 0  # bytes dropped from clients while silent
        self.open = 0  # client connections not closed by their client yet
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="silent-proxy").start()

    def silence(self) -> None:
        """Drop every byte from now on."""
        self.silent.set()

    def silence_from(self, marker: bytes) -> None:
        """Go silent at the first bytes from a client that contain ``marker`` (dropped too)."""
        self._marker = marker

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            upstream = socket.socket(self._family, socket.SOCK_STREAM)
            upstream.connect(self._address)
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
                self.open += 1
            for src, dst, from_client in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(
                    target=self._pump, args=(src, dst, from_client), daemon=True
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_client and self._marker is not None and self._marker in data:
                    self.silent.set()
                if self.silent.is_set():
                    if from_client:
                        self.dropped += len(data)
                    continue
                dst.sendall(data)
        except OSError:
            pass
        if from_client:
            with self._lock:
                self.open -= 1
        if not self.silent.is_set():  # a silent network does not say that a peer left
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        """Stop listening and close every connection."""
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        self._listener.close()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def __enter__(self) -> SilentProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
