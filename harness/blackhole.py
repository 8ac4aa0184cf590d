"""A black-holed endpoint: a TCP server on 127.0.0.1 that accepts every connection, reads
nothing and never answers, as an object store that hangs (a half-dead load balancer, a
server stuck in GC). Clients wait for their own read time-outs (s3fs with UCM's defaults: about
106 s per request). :meth:`BlackHole.close` closes every connection it accepted, so requests
still hanging fail at once (a test's teardown does not wait for them)."""

from __future__ import annotations

import socket
import threading
from types import TracebackType
from typing import Any


class BlackHole:
    def __init__(self, port: int = 0) -> None:
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(128)
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="blackhole", daemon=True)
        self._thread.start()

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs options for an ``s3://`` URL served by this endpoint (credentials are never
        checked: nothing answers)."""
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._held.append(conn)
                self.accepted += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._listener.close()
        with self._lock:
            held, self._held = self._held, []
        for conn in held:
            conn.close()

    def __enter__(self) -> BlackHole:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
