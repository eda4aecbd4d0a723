"""A TCP proxy that a chaos run puts between some workers and Redis, to cut their connections at will.

Cutting (`cut`) shuts every connection through it at once, both ways, as a network partition, a
load balancer's idle reaper or a NAT table flush would: the clients see a reset in the middle of
whatever they were doing (a blocking read, a script call) and must reconnect. New connections are
taken again at once.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class Proxy:
    """Listens on a free loopback port and forwards each connection to `upstream` (host, port)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        self._lose_reply = False
        self._servers: set[socket.socket] = set()
        self.connections = 0
        """Connections accepted so far."""
        threading.Thread(target=self._accept, name="chaos-proxy", daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def cut(self) -> int:
        """Reset every open connection; returns how many there were."""
        with self._lock:
            doomed, self._open = self._open, set()
        for sock in doomed:
            with contextlib.suppress(OSError):  # linger 0: the close after the shutdown resets the connection
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            _shut(sock)
        return len(doomed) // 2

    def lose_next_reply(self) -> None:
        """Drop the next bytes Redis sends and reset that connection: a reply lost after its command ran."""
        self._lose_reply = True

    def close(self) -> None:
        self._closed = True
        _shut(self._listener)
        self.cut()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=2)
            except OSError:  # Redis is down: the client sees its connection closed, as it would without us
                _shut(client)
                continue
            server.settimeout(None)
            with self._lock:
                self._open |= {client, server}
                self._servers.add(server)
                self.connections += 1
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if self._lose_reply and source in self._servers:
                    self._lose_reply = False
                    sink.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open -= {source, sink}
                self._servers -= {source, sink}
            _shut(source)
            _shut(sink)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
