"""Fixtures for the built-in tiers: a real S3 server (moto) and a real mooncake_master on
127.0.0.1, and tier builders."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ucm_backends.fsspec_tier import FsspecConfig, FsspecTier
from ucm_backends.posix import PosixConfig, PosixTier

from harness.mooncake import MooncakeMaster
from harness.s3 import S3_TEST_BUCKET, S3Server, shared_server
from ucm.layout import Layout
from ucm.testing import make_context
from ucm.tier import EvictSink, Tier, TierContext

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
    test process (harness.s3.shared_server), with dummy credentials in the environment so
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


# ---- Mooncake Store (a real mooncake_master on 127.0.0.1, harness.mooncake) ----------

MOONCAKE_LEASE_MS = 500
"""Read lease of the shared test master: long beside a test transfer, short enough that
tests waiting for leases to lapse (MooncakeConformance.wait_for_read_leases) stay quick."""


@pytest.fixture(scope="session")
def mooncake() -> None:
    """Mooncake is importable; a test needing it skips without it, except under CI."""
    from harness.mooncake import missing_reason, on_ci

    reason = missing_reason()
    if reason is not None:
        if on_ci():
            pytest.fail(f"CI must run the Mooncake tests: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def mooncake_master(mooncake: None) -> Iterator[MooncakeMaster]:
    """One master for the tests that neither stop it nor need other flags."""
    with MooncakeMaster(lease_ttl_ms=MOONCAKE_LEASE_MS) as master:
        yield master


@pytest.fixture
def new_master(mooncake: None) -> Iterator[Callable[..., MooncakeMaster]]:
    """``new_master(lease_ttl_ms=..., client_ttl_s=...)``: a master of the test's own (to kill,
    restart, fill up); every one is stopped after the test, whatever happened."""
    masters: list[MooncakeMaster] = []

    def make(**options: Any) -> MooncakeMaster:
        master = MooncakeMaster(**options)
        masters.append(master)
        return master.start()

    yield make
    for master in masters:
        master.kill()


def mooncake_tier(
    master: MooncakeMaster, layout: Layout, context: TierContext | None = None, **options: Any
) -> Tier:
    from ucm_backends.mooncake import MooncakeConfig, MooncakeTier

    config = MooncakeConfig(
        master_server_address=master.address, local_hostname="127.0.0.1", **options
    )
    return MooncakeTier(config, context or make_context(layout))
