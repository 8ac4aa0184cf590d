"""The fault proxy the serving soak and the deadline tests put in front of real servers."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from harness.faults import BlackHole, FaultProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield ("127.0.0.1", int(server.server_address[1]))
    finally:
        server.shutdown()
        server.server_close()


def _ask(port: int, payload: bytes, timeout_s: float) -> bytes | None:
    """Sends ``payload``; what comes back (b"" for a closed or reset connection), None on a
    time-out."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.settimeout(timeout_s)
        sock.sendall(payload)
        received = b""
        try:
            while len(received) < len(payload):
                chunk = sock.recv(65536)
                if not chunk:
                    return received
                received += chunk
        except TimeoutError:
            return None
        except ConnectionResetError:
            return b""  # closed with our bytes unread: the kernel answers with a reset
        return received


def test_modes_forward_swallow_and_refuse_per_connection(echo: tuple[str, int]) -> None:
    payload = bytes(range(256)) * 1024
    with FaultProxy(echo) as proxy:
        assert _ask(proxy.port, payload, 30) == payload
        proxy.set_mode("blackhole")
        assert _ask(proxy.port, b"anyone there?", 1.0) is None
        proxy.set_mode("refuse")
        assert _ask(proxy.port, b"hello", 30) == b""
        proxy.set_mode("forward")
        assert _ask(proxy.port, b"healthy again", 30) == b"healthy again"
        assert proxy.accepted_by_mode == {"forward": 2, "blackhole": 1, "refuse": 1}
        assert proxy.accepted == 4


def test_a_black_holed_connection_stays_black_holed_and_stop_closes_it(
    echo: tuple[str, int],
) -> None:
    proxy = FaultProxy(echo, mode="blackhole").start()
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
    sock.sendall(b"lost")
    deadline = time.monotonic() + 60
    while proxy.accepted_by_mode["blackhole"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # the mode is the one the proxy accepted the connection in
    assert proxy.accepted_by_mode["blackhole"] == 1
    proxy.set_mode("forward")  # does not heal the connection accepted before
    sock.settimeout(1.0)
    with pytest.raises(TimeoutError):
        sock.recv(16)
    proxy.stop()
    sock.settimeout(30)
    with contextlib.suppress(ConnectionResetError):  # closed with our bytes unread: a reset
        assert sock.recv(16) == b""  # the proxy's stop closed it
    sock.close()


def test_a_bad_mode_names_the_valid_ones(echo: tuple[str, int]) -> None:
    with pytest.raises(ValueError, match="mode must be one of forward, blackhole, refuse, got 'x'"):
        FaultProxy(echo, mode="x")  # type: ignore[arg-type]
    with BlackHole() as hole, pytest.raises(ValueError, match="mode 'forward' needs a target"):
        hole.set_mode("forward")
