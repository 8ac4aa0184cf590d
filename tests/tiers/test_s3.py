"""fsspec tier on s3:// through s3fs against a real S3 server (moto) on 127.0.0.1."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import pytest
from ucm_backends.fsspec_tier import FsspecConfig, FsspecTier

from ucm.errors import KeyMissingError, TierError
from ucm.layout import Layout
from ucm.testing import make_context
from ucm.testing.conformance import assert_loads_exact, block_ids, dump_keys, load_keys

from . import _workers
from .conftest import S3_BUCKET, free_port, fsspec_tier

LAYOUT = Layout(shard_size=2048, shards_per_block=2, tensor_sizes=(2048,))


def test_second_node_in_another_process_shares_blocks(
    s3_url: str, s3_options: dict[str, Any]
) -> None:
    blocks = block_ids(3)
    ctx = multiprocessing.get_context("spawn")
    node = ctx.Process(target=_workers.dump_to_fsspec, args=(s3_url, s3_options, LAYOUT, blocks))
    node.start()
    node.join(timeout=120)
    assert node.exitcode == 0
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


def test_corrupt_object_is_a_miss_and_removed(s3_url: str, s3_options: dict[str, Any]) -> None:
    tier = fsspec_tier(s3_url, LAYOUT, storage_options=s3_options)
    (block,) = block_ids(1)
    dump_keys(tier, [(block, 0), (block, 1)])
    tier.fs.pipe_file(tier.object_path((block, 1)), b"UCMF" + bytes(100))
    outcomes, _ = load_keys(tier, [(block, 0), (block, 1)])
    assert outcomes[0] is None
    assert isinstance(outcomes[1], KeyMissingError)
    assert "is corrupt (104 bytes, expected 2064); it was removed" in str(outcomes[1])
    assert not tier.fs.exists(tier.object_path((block, 1)))
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
    present = tier.lookup([(block, 0)])
    elapsed = time.monotonic() - started
    assert elapsed < 20, f"a down endpoint took {elapsed:.1f}s"
    for outcome, verb in ((dumped[0], "writing"), (loaded[0], "loading")):
        assert isinstance(outcome, TierError) and not isinstance(outcome, KeyMissingError)
        assert str(outcome).startswith(
            f"fsspec tier 'fsspec' (s3://{S3_BUCKET}/down): {verb} block {block.hex()} shard 0: "
            "EndpointConnectionError: Could not connect to the endpoint URL"
        )
    assert present == [False]
    assert tier.stats()["errors"] == 3
    tier.close()
