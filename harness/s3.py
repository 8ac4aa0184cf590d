"""A real S3-compatible server (moto) on 127.0.0.1 for tests and benchmarks.

The server runs in a thread of the calling process and speaks the S3 protocol over HTTP, so
tiers in any process (spawned rank processes included) reach it through s3fs exactly as they
would reach a remote object store. It counts the requests it serves (by HTTP method, and GETs of
object keys separately) so a test can prove that a load did *not* touch S3, and it can add a
fixed latency to requests of chosen methods to make write-through work observably slow, or
answer them with an HTTP error (:meth:`S3Server.set_failure`)::

    with S3Server() as s3:
        url = s3.url("my-prefix")              # s3://ucm-test/my-prefix
        options = s3.storage_options           # endpoint, credentials, region
        before = s3.requests()
        ...
        assert s3.requests() - before == Counter()

moto keeps its buckets in process-global state, so every server of one process sees the same
buckets; :func:`shared_server` hands out one server per process, stopped at exit.
"""

from __future__ import annotations

import atexit
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

S3_TEST_BUCKET = "ucm-test"
S3_TEST_REGION = "us-east-1"
_CREDENTIALS = {"key": "testing", "secret": "testing"}
_START_TIMEOUT_S = 20.0

Environ = dict[str, Any]
StartResponse = Callable[..., Any]
WsgiApp = Callable[[Environ, StartResponse], Iterable[bytes]]


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on (at the time of the call)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class S3Server:
    """moto's S3 behind a counting WSGI layer, served by werkzeug on 127.0.0.1."""

    def __init__(self, bucket: str = S3_TEST_BUCKET, port: int = 0) -> None:
        self.bucket = bucket
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._delays: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # ---- what clients need ------------------------------------------------------------------

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options reaching this server (no environment variables needed)."""
        return {
            "endpoint_url": self.endpoint,
            **_CREDENTIALS,
            "client_kwargs": {"region_name": S3_TEST_REGION},
        }

    def url(self, prefix: str | None = None) -> str:
        """``s3://<bucket>/<prefix>``; a fresh random prefix when none is given."""
        return f"s3://{self.bucket}/{prefix or uuid.uuid4().hex}"

    # ---- counters and latency ---------------------------------------------------------------

    def requests(self) -> Counter[str]:
        """Requests served so far: by HTTP method (``GET``, ``PUT``, ``HEAD``, ``DELETE``,
        ``POST``), plus ``GET object`` for GETs of an object key (reads of shard data) and
        ``total``. Subtract two snapshots to see what happened in between."""
        with self._lock:
            return Counter(self._requests)

    def set_delay(self, method: str, seconds: float) -> None:
        """Every later request with this HTTP method (or ``GET object``: reads of object data
        only, not listings) waits ``seconds`` before it is served (0 removes the delay): a slow
        object store, for tests of asynchronous writes and late loads."""
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        kind = method if method == "GET object" else method.upper()
        with self._lock:
            if seconds:
                self._delays[kind] = seconds
            else:
                self._delays.pop(kind, None)

    def set_failure(self, kind: str, status: int) -> None:
        """Every later request of ``kind`` (an HTTP method, or ``GET object`` for reads of
        object data) is answered with HTTP ``status`` and an S3 error body instead of being
        served (0 serves them again): an object store that lists but cannot read."""
        if status and not 400 <= status <= 599:
            raise ValueError(f"status must be an HTTP error status (400-599) or 0, got {status!r}")
        with self._lock:
            if status:
                self._failures[kind if kind == "GET object" else kind.upper()] = status
            else:
                self._failures.pop(kind if kind == "GET object" else kind.upper(), None)

    def _app(self, inner: WsgiApp) -> WsgiApp:
        def app(environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
            method = str(environ.get("REQUEST_METHOD", "")).upper()
            # Path-style addressing: /<bucket>/<key...>; a GET with a key reads an object.
            parts = str(environ.get("PATH_INFO", "")).strip("/").split("/", 1)
            reads_object = method == "GET" and len(parts) == 2 and bool(parts[1])
            with self._lock:
                self._requests[method] += 1
                self._requests["total"] += 1
                if reads_object:
                    self._requests["GET object"] += 1
                delay = self._delays.get(method, 0.0) or (
                    self._delays.get("GET object", 0.0) if reads_object else 0.0
                )
                failure = self._failures.get(method, 0) or (
                    self._failures.get("GET object", 0) if reads_object else 0
                )
            if delay:
                time.sleep(delay)
            if failure:
                body = (
                    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable'
                    b"</Code><Message>failure injected by the test server</Message></Error>"
                )
                start_response(
                    f"{failure} Injected Failure",
                    [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
                )
                return [body]
            return inner(environ, start_response)

        return app

    # ---- life cycle -------------------------------------------------------------------------

    def start(self) -> S3Server:
        from moto.moto_server import werkzeug_app  # type: ignore[import-untyped,unused-ignore]
        from werkzeug.serving import WSGIRequestHandler, make_server

        # moto >= 5.2.5 ships a handler that keeps underscores in S3 metadata headers; older
        # releases (5.2.1 is preinstalled on CI's interpreter) have none, and werkzeug's serves.
        base_handler: type[WSGIRequestHandler] = getattr(
            werkzeug_app, "MotoRequestHandler", WSGIRequestHandler
        )

        class QuietHandler(base_handler):  # type: ignore[misc,valid-type,unused-ignore]
            def log_request(self, *args: Any, **kwargs: Any) -> None:
                pass  # one line per request on stderr drowns test output

        inner = werkzeug_app.DomainDispatcherApplication(werkzeug_app.create_backend_app)
        self._server = make_server(
            "127.0.0.1",
            self.port,
            self._app(inner),
            threaded=True,
            request_handler=QuietHandler,
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="ucm-test-s3", daemon=True
        )
        self._thread.start()
        self._create_bucket()
        return self

    def _create_bucket(self) -> None:
        import boto3  # type: ignore[import-untyped,unused-ignore]

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=S3_TEST_REGION,
            aws_access_key_id=_CREDENTIALS["key"],
            aws_secret_access_key=_CREDENTIALS["secret"],
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                client.create_bucket(Bucket=self.bucket)
                return
            except client.exceptions.BucketAlreadyOwnedByYou:
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


_shared: S3Server | None = None
_shared_lock = threading.Lock()


def shared_server() -> S3Server:
    """This process's test S3 server, started on first use and stopped at exit."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = S3Server().start()
            atexit.register(_shared.stop)
        return _shared
