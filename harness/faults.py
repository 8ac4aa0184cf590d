"""A TCP fault proxy for UCM's tests: a server on 127.0.0.1 that forwards to a real one (an S3
server, a Mooncake master) or plays a broken network, switchable while clients are connected::

    with FaultProxy(("127.0.0.1", s3.port)) as proxy:     # forwards: a healthy endpoint
        options = {**s3.storage_options, "endpoint_url": proxy.endpoint}
        proxy.set_mode("blackhole")   # accepts, never reads, never answers (the worst case
                                      # for a client: no error; only its time-outs end it)
        proxy.set_mode("refuse")      # accepts and closes at once: EOF or a reset (a crash)
        proxy.set_mode("forward")     # healthy again; connections opened before stay as they were

:class:`BlackHole` is a proxy with nowhere to forward to: an endpoint that accepts every
connection and never answers (a half-dead load balancer, a server stuck in GC); clients wait
for their own time-outs (s3fs with UCM's defaults: about 106 s per request).

A connection keeps the mode it was accepted in: a black-holed connection stays black-holed
(until the proxy stops), as a request lost in a real network stays lost. Every loop is bounded by
a poll interval and the proxy's stop flag; :meth:`stop` closes every socket.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal

Mode = Literal["forward", "blackhole", "refuse"]
MODES: tuple[str, ...] = ("forward", "blackhole", "refuse")
POLL_S = 0.2
"""How long a proxy thread waits on its sockets before it looks at the stop flag again."""
CHUNK_BYTES = 256 * 1024


class FaultProxy:
    """Forwards TCP connections to ``target`` or fails them per :meth:`set_mode`."""

    def __init__(
        self, target: tuple[str, int] | None, mode: Mode = "forward", port: int = 0
    ) -> None:
        self.target = target
        self._mode: Mode = self._checked(mode)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(128)
        self.port: int = int(self._listener.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self.accepted_by_mode: dict[str, int] = dict.fromkeys(MODES, 0)
        """Connections accepted so far, by the mode they were accepted in."""

    def _checked(self, mode: str) -> Mode:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "forward" and self.target is None:
            raise ValueError("mode 'forward' needs a target: this proxy has none (a BlackHole)")
        return mode  # type: ignore[return-value]

    @property
    def accepted(self) -> int:
        """Connections accepted so far, in every mode."""
        with self._lock:
            return sum(self.accepted_by_mode.values())

    @property
    def mode(self) -> Mode:
        with self._lock:
            return self._mode

    def set_mode(self, mode: Mode) -> None:
        """Connections accepted from now on are forwarded, black-holed or refused."""
        checked = self._checked(mode)
        with self._lock:
            self._mode = checked

    def start(self) -> FaultProxy:
        self._spawn(self._accept_loop, "ucm-fault-proxy")
        return self

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
            self._sockets.clear()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()
        for thread in list(self._threads):
            thread.join(timeout=5 * POLL_S + 5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- internals ---------------------------------------------------------------------------

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _track(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._stopping.is_set():
                return False
            self._sockets.add(sock)
            return True

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                readable, _, _ = select.select([self._listener], [], [], POLL_S)
            except (OSError, ValueError):
                return
            if not readable:
                continue
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._track(client):
                client.close()
                return
            mode = self.mode
            with self._lock:
                self.accepted_by_mode[mode] += 1
            if mode == "refuse":
                self._close(client)
            elif mode == "blackhole":
                pass  # held open, never read, never answered: stop() closes it
            else:
                self._spawn(self._forward, "ucm-fault-forward", client)

    def _close(self, *socks: socket.socket) -> None:
        for sock in socks:
            with self._lock:
                self._sockets.discard(sock)
            with contextlib.suppress(OSError):
                sock.close()

    def _forward(self, client: socket.socket) -> None:
        assert self.target is not None, "forward mode needs a target"
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            self._close(client)
            return
        if not self._track(upstream):
            self._close(client, upstream)
            return
        peers = {client: upstream, upstream: client}
        while not self._stopping.is_set():
            try:
                readable, _, _ = select.select(list(peers), [], [], POLL_S)
                done = False
                for sock in readable:
                    data = sock.recv(CHUNK_BYTES)
                    if not data:
                        done = True
                        break
                    peers[sock].sendall(data)
                if done:
                    break
            except (OSError, ValueError):
                break
        self._close(client, upstream)


class BlackHole(FaultProxy):
    """An endpoint on 127.0.0.1 (``port``, or a free one) that accepts every connection and
    never answers; started on construction. :meth:`close` closes every connection it accepted,
    so requests still hanging fail at once (a test's teardown does not wait for them)."""

    def __init__(self, port: int = 0) -> None:
        super().__init__(None, mode="blackhole", port=port)
        self.start()

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs options for an ``s3://`` URL served by this endpoint (credentials are never
        checked: nothing answers)."""
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> BlackHole:
        return self


__all__ = ["MODES", "BlackHole", "FaultProxy", "Mode"]
