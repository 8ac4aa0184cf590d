"""Fixtures for the built-in tiers: a real S3 server (moto) on 127.0.0.1 and tier builders."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ucm_backends.fsspec_tier import FsspecConfig, FsspecTier
from ucm_backends.posix import PosixConfig, PosixTier

from ucm.layout import Layout
from ucm.testing import make_context
from ucm.testing.s3 import S3_TEST_BUCKET, S3Server, shared_server
from ucm.tier import EvictSink, Tier

S3_BUCKET = S3_TEST_BUCKET
_DUMMY_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A real S3-compatible server (moto) on 127.0.0.1, with the test bucket created; one per
    test process (ucm.testing.s3.shared_server), with dummy credentials in the environment so
    spawned processes and option-less clients reach it too."""
    pytest.importorskip("s3fs")
    saved = {name: os.environ.get(name) for name in _DUMMY_AWS}
    os.environ.update(_DUMMY_AWS)
    try:
        yield shared_server()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def s3_endpoint(s3_server: S3Server) -> str:
    return s3_server.endpoint


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
def s3_options(s3_server: S3Server) -> dict[str, Any]:
    return s3_server.storage_options


TierBuilder = Callable[[Layout], Tier]
