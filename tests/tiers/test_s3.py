"""fsspec tier on s3:// through s3fs against a real S3 server (moto) on 127.0.0.1."""

from __future__ import annotations

import copy
import socket
import struct
import time
from typing import Any

import pytest
from ucm_backends.fsspec_tier import (
    S3_DEFAULT_CONFIG,
    FsspecConfig,
    FsspecTier,
    default_request_timeout,
)

from harness.s3 import free_port
from ucm.errors import KeyMissingError, TierError
from ucm.layout import Layout
from ucm.native.checksum import checksum
from ucm.ranks import RankGroup
from ucm.testing import make_context
from ucm.testing.conformance import (
    assert_loads_exact,
    block_ids,
    dump_keys,
    load_keys,
    shard_bytes,
)

from . import _workers
from .conftest import S3_BUCKET, fsspec_tier

LAYOUT = Layout(shard_size=2048, shards_per_block=2, tensor_sizes=(2048,))


def test_second_node_in_another_process_shares_blocks(
    s3_url: str, s3_options: dict[str, Any]
) -> None:
    blocks = block_ids(3)
    with RankGroup(parties=1, join_timeout=120) as group:
        group.spawn(_workers.dump_to_fsspec, s3_url, s3_options, LAYOUT, blocks)
    assert group.join() == [0]
    tier = FsspecTier(
        FsspecConfig(url=s3_url, storage_options=s3_options),
        make_context(LAYOUT, unique_id="this-node"),
    )
    assert tier.lookup_blocks(blocks) == [True, True, True]
    assert_loads_exact(tier, LAYOUT.keys_of_blocks(blocks))
    tier.close()


def test_new_blocks_of_other_nodes_are_seen(s3_url: str, s3_options: dict[str, Any]) -> None:
    reader = fsspec_tier(s3_url, LAYOUT, storage_options=s3_options)
    writer = fsspec_tier(s3_url, LAYOUT, storage_options=s3_options)
    (block,) = block_ids(1)
    assert reader.lookup([(block, 0)]) == [False]
    dump_keys(writer, [(block, 0)])
    assert reader.lookup([(block, 0)]) == [True]  # no stale listing cache
    assert_loads_exact(reader, [(block, 0)])
    reader.close()
    writer.close()


def test_corrupt_object_fails_and_is_removed(s3_url: str, s3_options: dict[str, Any]) -> None:
    tier = fsspec_tier(s3_url, LAYOUT, storage_options=s3_options)
    (block,) = block_ids(1)
    dump_keys(tier, [(block, 0), (block, 1)])
    raw = bytearray(tier.fs.cat_file(tier.object_path((block, 1))))
    tier.fs.pipe_file(tier.object_path((block, 1)), bytes(raw[:104]))
    outcomes, _ = load_keys(tier, [(block, 0), (block, 1)])
    assert outcomes[0] is None
    assert isinstance(outcomes[1], TierError) and not isinstance(outcomes[1], KeyMissingError)
    assert "is corrupt (104 bytes, expected 2096); it was removed" in str(outcomes[1])
    assert not tier.fs.exists(tier.object_path((block, 1)))
    tier.close()


def test_object_of_the_older_format_is_a_miss(s3_url: str, s3_options: dict[str, Any]) -> None:
    # A whole, valid UCF2 object (the format before the shard envelope): never data.
    tier = fsspec_tier(s3_url, LAYOUT, storage_options=s3_options)
    (block,) = block_ids(1)
    data = shard_bytes((block, 0), LAYOUT)
    old = struct.pack("<4sQQ", b"UCF2", checksum([data]), LAYOUT.shard_size) + data
    tier.fs.pipe_file(tier.object_path((block, 0)), old)
    assert tier.lookup([(block, 0)]) == [True]  # listed, until a load reads it
    outcomes, buffers = load_keys(tier, [(block, 0)])
    assert isinstance(outcomes[0], KeyMissingError)
    assert "written in an older format, a fsspec object (UCF2)" in str(outcomes[0])
    assert buffers[0] == bytearray(LAYOUT.shard_size)
    assert not tier.fs.exists(tier.object_path((block, 0)))
    tier.close()


def test_objects_live_under_the_url_prefix(s3_url: str, s3_options: dict[str, Any]) -> None:
    tier = fsspec_tier(s3_url, LAYOUT, storage_options=s3_options)
    (block,) = block_ids(1)
    dump_keys(tier, [(block, 1)])
    prefix = s3_url.removeprefix("s3://")
    assert tier.fs.find(prefix) == [f"{prefix}/{block.hex()[:2]}/{block.hex()}/1"]
    assert prefix.startswith(f"{S3_BUCKET}/")
    tier.close()


@pytest.mark.timeout(60)
def test_endpoint_down_fails_in_bounded_time(s3_endpoint: str) -> None:
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tier = fsspec_tier(f"s3://{S3_BUCKET}/down", LAYOUT, storage_options={"endpoint_url": down})
    (block,) = block_ids(1)
    started = time.monotonic()
    dumped = tier.dump([(block, 0)], [[memoryview(bytes(2048))]])
    loaded, _ = load_keys(tier, [(block, 0)])
    # A look-up has no per-key outcome: it raises, and the store answers "miss" (its breaker
    # counts the failure).
    with pytest.raises(TierError) as looked:
        tier.lookup([(block, 0)])
    elapsed = time.monotonic() - started
    assert elapsed < 20, f"a down endpoint took {elapsed:.1f}s"
    for outcome, verb in ((dumped[0], "writing"), (loaded[0], "loading")):
        assert isinstance(outcome, TierError) and not isinstance(outcome, KeyMissingError)
        assert str(outcome).startswith(
            f"fsspec tier 'fsspec' (s3://{S3_BUCKET}/down): {verb} block {block.hex()} shard 0: "
            "EndpointConnectionError: Could not connect to the endpoint URL"
        )
    assert str(looked.value).startswith(
        f"fsspec tier 'fsspec' (s3://{S3_BUCKET}/down): look-up of 1 of 1 block(s) failed: "
        "EndpointConnectionError: Could not connect to the endpoint URL"
    )
    assert tier.stats()["errors"] == 3
    tier.close()


def test_request_timeout_defaults_from_the_s3_client_timeouts(
    s3_url: str, s3_options: dict[str, Any]
) -> None:
    before = copy.deepcopy(S3_DEFAULT_CONFIG)
    tier = fsspec_tier(s3_url, LAYOUT, storage_options=s3_options)
    assert tier.lookup([(bytes(16), 0)]) == [False]  # botocore built its client
    tier.close()
    assert before == S3_DEFAULT_CONFIG  # it rewrote a copy, not the module's defaults
    # botocore's max_attempts counts retries: 2 means 3 tries; s3fs's own loop: 1 try.
    assert default_request_timeout("s3://b/p", {}) == (5 + 30) * 3 * 1 + 1.0
    tight = {"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 3}}
    assert default_request_timeout("s3://b/p", {"config_kwargs": tight, "retries": 2}) == 25.0
    total = {"connect_timeout": 1, "read_timeout": 1, "retries": {"total_max_attempts": 2}}
    assert default_request_timeout("s3://b/p", {"config_kwargs": total}) == 5.0
    assert default_request_timeout("memory://p", {}) is None
    assert default_request_timeout("file:///tmp/p", {}) is None


@pytest.mark.timeout(60)
def test_a_silent_endpoint_fails_a_dump_within_the_request_timeout(s3_endpoint: str) -> None:
    # The port accepts connections (kernel backlog) and never answers: botocore's read_timeout
    # does not end a PUT there; the tier's per-request timeout does.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        options = {
            "endpoint_url": f"http://127.0.0.1:{silent.getsockname()[1]}",
            "config_kwargs": {
                "connect_timeout": 1,
                "read_timeout": 1,
                "retries": {"max_attempts": 1},
            },
        }
        tier = fsspec_tier(f"s3://{S3_BUCKET}/silent", LAYOUT, storage_options=options)
        (block,) = block_ids(1)
        started = time.monotonic()
        dumped = tier.dump([(block, 0)], [[memoryview(bytes(2048))]])
        elapsed = time.monotonic() - started
        assert elapsed < 10, f"a dump to a silent endpoint took {elapsed:.1f}s"
        assert isinstance(dumped[0], TierError) and not isinstance(dumped[0], KeyMissingError)
        assert str(dumped[0]).startswith(
            f"fsspec tier 'fsspec' (s3://{S3_BUCKET}/silent): writing block {block.hex()} "
            "shard 0: FSTimeoutError"
        )
        tier.close()
