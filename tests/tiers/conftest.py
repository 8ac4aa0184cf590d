"""Fixtures for the built-in tiers: a real S3 server (moto) on 127.0.0.1 and tier builders."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ucm_backends.fsspec_tier import FsspecConfig, FsspecTier
from ucm_backends.posix import PosixConfig, PosixTier

from ucm.layout import Layout
from ucm.testing import make_context
from ucm.tier import EvictSink, Tier

S3_BUCKET = "ucm-test"
_DUMMY_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3-compatible server (moto) on 127.0.0.1, with the test bucket created."""
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    saved = {name: os.environ.get(name) for name in _DUMMY_AWS}
    os.environ.update(_DUMMY_AWS)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        deadline = time.monotonic() + 20
        while True:
            try:
                client.create_bucket(Bucket=S3_BUCKET)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield endpoint
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def posix_tier(
    path: Path | str, layout: Layout, evict_sink: EvictSink | None = None, **options: Any
) -> PosixTier:
    config = PosixConfig(path=str(path), io_threads=options.pop("io_threads", 2), **options)
    return PosixTier(config, make_context(layout, evict_sink=evict_sink))


def fsspec_tier(
    url: str, layout: Layout, evict_sink: EvictSink | None = None, **options: Any
) -> FsspecTier:
    config = FsspecConfig(url=url, io_threads=options.pop("io_threads", 4), **options)
    return FsspecTier(config, make_context(layout, evict_sink=evict_sink))


@pytest.fixture
def memory_url() -> str:
    return f"memory://ucm-tests/{uuid.uuid4().hex}"


@pytest.fixture
def s3_url(s3_endpoint: str) -> str:
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture
def s3_options(s3_endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": s3_endpoint}


TierBuilder = Callable[[Layout], Tier]
