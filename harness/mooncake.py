"""A real ``mooncake_master`` on 127.0.0.1 for tests and benchmarks (the way
:mod:`harness.s3` runs a moto S3 server).

The master is the binary the ``mooncake-transfer-engine-non-cuda`` wheel ships, started on free
127.0.0.1 ports with everything the tests do not need switched off (metric reporting, the HTTP
metadata server: clients use ``P2PHANDSHAKE``), and stopped by pid::

    with MooncakeMaster(lease_ttl_ms=500) as master:
        tier_config = {"type": "mooncake", "master_server_address": master.address,
                       "local_hostname": "127.0.0.1"}
        master.kill()        # SIGKILL, as a crash would
        master.start()       # again, on the same ports

Cleanup is robust: every master is stopped at interpreter exit, and the kernel kills it when
the thread that started it goes away (``PR_SET_PDEATHSIG``), so a crashed test run leaves no
master behind. Its RPC and admin (metrics) ports bind 127.0.0.1. A Mooncake *client* (every
process with a mooncake tier) binds its handshake and transfer ports on every interface
(Mooncake has no flag for that); clients given ``local_hostname: 127.0.0.1`` only ever connect
to 127.0.0.1.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType

from .s3 import free_port

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
_START_ATTEMPTS = 5
_PR_SET_PDEATHSIG = 1


def master_binary() -> Path | None:
    """The ``mooncake_master`` binary inside the installed ``mooncake`` package (found without
    importing it), or None when the package is not installed."""
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "mooncake_master"
        if candidate.is_file():
            return candidate
    return None


def missing_reason() -> str | None:
    """Why Mooncake cannot be used here (None when it can): the package, its binary, or the
    system library its ``store.so`` needs."""
    if master_binary() is None:
        return (
            "Mooncake is not installed (pip install 'ucm[mooncake]', which brings "
            "mooncake-transfer-engine-non-cuda)"
        )
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"mooncake.store does not import ({exc}); Debian: apt-get install libibverbs1"
    return None


def on_ci() -> bool:
    """``CI=true`` (the tests' CI rule, tests/conftest.py): what needs Mooncake must fail, not
    skip, when Mooncake is missing."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _accepts(port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """One ``mooncake_master`` process on 127.0.0.1.

    ``lease_ttl_ms``: how long a read leases an object (``--default_kv_lease_ttl``; Mooncake's
    default is 10 s). ``client_ttl_s``: how long a client that stopped heart-beating keeps its
    segment mounted (``--client_ttl``). ``extra_args``: more ``--flag=value`` arguments.
    """

    def __init__(
        self,
        *,
        lease_ttl_ms: int | None = None,
        client_ttl_s: int | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        binary = master_binary()
        if binary is None:
            raise RuntimeError(missing_reason() or "mooncake_master not found")
        self.binary = binary
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.extra_args = extra_args
        self.port = 0
        self.metrics_port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._log_dir = tempfile.mkdtemp(prefix="ucm-mooncake-master-")
        self.log_path = Path(self._log_dir) / "master.log"
        _started.add(self)

    # ---- what clients need ------------------------------------------------------------------

    @property
    def address(self) -> str:
        """``127.0.0.1:<rpc port>``: a tier's ``master_server_address``."""
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log(self, tail_bytes: int = 4000) -> str:
        """The end of the master's log (for assertion messages)."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-tail_bytes:].decode(errors="replace")

    # ---- life cycle -------------------------------------------------------------------------

    def _args(self) -> list[str]:
        args = [
            str(self.binary),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--enable_metric_reporting=false",
            "--enable_http_metadata_server=false",
            "--rpc_thread_num=2",
            "--logtostderr",
        ]
        if self.lease_ttl_ms is not None:
            args.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        if self.client_ttl_s is not None:
            args.append(f"--client_ttl={self.client_ttl_s}")
        return args + list(self.extra_args)

    def start(self) -> MooncakeMaster:
        """Starts the master (on the ports it had before, if it ran already) and waits until it
        accepts connections. Fresh ports are picked when a first start finds them taken."""
        if self.running():
            return self
        keep_ports = bool(self.port)
        last = ""
        for attempt in range(_START_ATTEMPTS):
            if not keep_ports or not self.port:
                self.port, self.metrics_port = free_port(), free_port()
            if self._launch():
                return self
            last = self.log()
            if keep_ports:  # a restart: the old ports may linger in TIME_WAIT for a moment
                time.sleep(0.5 * (attempt + 1))
        raise RuntimeError(f"mooncake_master did not start; its log ends with:\n{last}")

    def _launch(self) -> bool:
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self._process = subprocess.Popen(
                self._args(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
                close_fds=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:  # e.g. a port taken meanwhile
                self._process = None
                return False
            if _accepts(self.port) and _accepts(self.metrics_port):
                return True
            time.sleep(0.05)
        self.kill()
        return False

    def kill(self) -> None:
        """SIGKILL, as a crash would; returns once the process is gone."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM (SIGKILL after STOP_TIMEOUT_S); returns once the process is gone."""
        self._signal(signal.SIGTERM)

    def _signal(self, signum: int) -> None:
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signum)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_TIMEOUT_S)
        self._process = None

    def listening_addresses(self) -> set[tuple[str, int]]:
        """(IPv4 address, port) of every TCP socket the master process listens on."""
        if self._process is None:
            return set()
        return listening_addresses(self._process.pid)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets process ``pid`` listens on, from /proc (IPv4 as
    dotted quads, IPv6 as ``[hex]``)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for entry in fd_dir.iterdir():
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found: set[tuple[str, int]] = set()
    for table, family in ((f"/proc/{pid}/net/tcp", 4), (f"/proc/{pid}/net/tcp6", 6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            host = socket.inet_ntoa(raw[::-1]) if family == 4 else f"[{address}]"
            found.add((host, int(port, 16)))
    return found


_started: weakref.WeakSet[MooncakeMaster] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for master in list(_started):
        master.kill()
