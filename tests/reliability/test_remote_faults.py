"""Remote faults: the S3 server (moto, on 127.0.0.1) goes down in the middle of a run and comes
back on the same port, or accepts connections and never answers. Requests fail (or answer
"absent") within their timeouts, nothing hangs, and the running store serves again once the
server is back."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import ucm
from harness.s3 import S3Server
from harness.soak import block_id_of
from ucm.errors import KeyMissingError, TaskError, TierError

from .conftest import SHARD, Shards, payload

# Tight client timeouts so the test is short; the bound below follows from them.
S3_CONFIG = {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}
OP_BOUND_S = 8.0
PROCESS_SLACK_S = 30.0
"""Start-up (interpreter, imports, open) and exit of a child process, on top of an op's bound:
the op itself is timed inside the child and held to ``OP_BOUND_S``."""


def s3_stack(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    options = {**storage_options, "config_kwargs": S3_CONFIG}
    return {
        "unique_id": f"rel-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [{"type": "fsspec", "url": url, "storage_options": options}],
    }


@dataclass
class Op:
    started: float
    seconds: float
    kind: str
    ok: bool
    error: str = ""


def _round_trip(store: ucm.Store, block_id: bytes, shards: Shards) -> None:
    """Dumps a block, then loads it back and checks every byte."""
    shards.fill([block_id], 0)
    store.wait(store.dump_data([block_id], 0, shards.pointers(1)))
    shards.poison()
    store.wait(store.load_data([block_id], 0, shards.pointers(1)))
    assert shards.data(0) == payload(block_id, 0)


@pytest.mark.timeout(120)
def test_s3_stopped_mid_run_fails_in_bounded_time_and_service_resumes() -> None:
    server = S3Server().start()
    try:
        config = s3_stack(server.url(), server.storage_options)
        with ucm.open(config) as store:
            before = [block_id_of(b"before", i) for i in range(3)]
            shards = Shards(3)
            for block_id in before:
                _round_trip(store, block_id, shards)
            ops: list[Op] = []
            stop = threading.Event()

            def worker() -> None:
                own = Shards(1)
                for i in range(10_000):
                    if stop.is_set():
                        return
                    started = time.monotonic()
                    try:
                        _round_trip(store, block_id_of(b"during", i), own)
                        ops.append(Op(started, time.monotonic() - started, "round trip", True))
                    except TaskError as error:
                        text = str(error)
                        ops.append(
                            Op(started, time.monotonic() - started, "round trip", False, text)
                        )
                    time.sleep(0.05)

            thread = threading.Thread(target=worker)
            thread.start()
            time.sleep(0.5)
            server.stop()
            down_at = time.monotonic()
            time.sleep(2.0)
            # Calls made while the server is down answer within the bound.
            started = time.monotonic()
            assert store.lookup(before) == [False, False, False]  # unreachable reads as absent
            lookup_s = time.monotonic() - started
            started = time.monotonic()
            with pytest.raises(TaskError) as down_load:
                store.wait(store.load_data(before[:1], 0, shards.pointers(1)))
            load_s = time.monotonic() - started
            (cause,) = down_load.value.failures.values()
            assert isinstance(cause, TierError) and not isinstance(cause, KeyMissingError)
            assert "Could not connect to the endpoint URL" in str(cause)
            started = time.monotonic()
            with pytest.raises(TierError) as down_remove:
                store.remove(before[2:])
            assert "batched_remove could not list blocks" in str(down_remove.value)
            remove_s = time.monotonic() - started
            server.start()  # same port, same (process-global) moto state
            up_at = time.monotonic()
            time.sleep(2.0)
            stop.set()
            thread.join(OP_BOUND_S * 2)
            assert not thread.is_alive(), "the worker hung"
            # Everything dumped before the outage is there again, byte-exact.
            shards.poison()
            store.wait(store.load_data(before, 0, shards.pointers(3)))
            assert [shards.data(i) for i in range(3)] == [payload(b, 0) for b in before]
            _round_trip(store, block_id_of(b"after", 0), shards)
        timeline = [(round(op.started - down_at, 2), round(op.seconds, 2), op.ok) for op in ops] + [
            ("up at", round(up_at - down_at, 2))
        ]
        for seconds in (lookup_s, load_s, remove_s, *(op.seconds for op in ops)):
            assert seconds < OP_BOUND_S, (lookup_s, load_s, remove_s, timeline)
        # Ops that began and ended while the server was down failed (an op whose retries
        # straddle the restart may succeed); ops begun once it was back all succeeded.
        down = [op for op in ops if op.started > down_at and op.started + op.seconds < up_at]
        assert down and not any(op.ok for op in down), timeline
        assert all("Could not connect to the endpoint URL" in op.error for op in down)
        after = [op for op in ops if op.started > up_at]
        assert after and all(op.ok for op in after), timeline
        assert sum(op.ok for op in ops if op.started < down_at) >= 1
    finally:
        server.stop()


class SilentEndpoint:
    """A TCP port whose connections complete in the kernel's backlog and are never read or
    answered: an object store that hangs."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.options = {
            "endpoint_url": f"http://127.0.0.1:{self.sock.getsockname()[1]}",
            "key": "testing",
            "secret": "testing",
        }

    def close(self) -> None:
        self.sock.close()


@pytest.mark.timeout(60)
def test_a_silent_endpoint_fails_loads_and_lookups_within_the_read_timeout() -> None:
    silent = SilentEndpoint()
    try:
        config = s3_stack(f"s3://ucm-test/{uuid.uuid4().hex}", silent.options)
        with ucm.open(config) as store:
            block_id = block_id_of(b"silent", 0)
            shards = Shards(1)
            started = time.monotonic()
            assert store.lookup([block_id]) == [False]
            lookup_s = time.monotonic() - started
            started = time.monotonic()
            with pytest.raises(TaskError) as error:
                store.wait(store.load_data([block_id], 0, shards.pointers(1)))
            load_s = time.monotonic() - started
        assert lookup_s < OP_BOUND_S and load_s < OP_BOUND_S, (lookup_s, load_s)
        (cause,) = error.value.failures.values()
        assert isinstance(cause, TierError) and not isinstance(cause, KeyMissingError)
        # botocore's read timeout or the tier's own request deadline, whichever fires first.
        assert "timeout" in str(cause).lower(), cause
    finally:
        silent.close()


SILENT_DUMP = r"""
import ctypes, json, sys, time
import ucm
config = json.loads(sys.argv[1])
store = ucm.open(config)
memory = ctypes.create_string_buffer(config["shard_size"])
started = time.monotonic()
try:
    store.wait(store.dump_data([bytes(16)], 0, [[ctypes.addressof(memory)]]))
    outcome = "ok"
except ucm.TaskError as error:
    outcome = str(error)
print(json.dumps({"seconds": time.monotonic() - started, "outcome": outcome}), flush=True)
"""


@pytest.mark.timeout(60)
def test_a_silent_endpoint_fails_dumps_within_the_timeout() -> None:
    # In a child process: the dump may block for good, and it is killed at the bound.
    silent = SilentEndpoint()
    try:
        config = s3_stack(f"s3://ucm-test/{uuid.uuid4().hex}", silent.options)
        child = subprocess.Popen(
            [sys.executable, "-c", SILENT_DUMP, json.dumps(config)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            out, _ = child.communicate(timeout=OP_BOUND_S + PROCESS_SLACK_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(10)
            pytest.fail(
                "a dump to a silent S3 endpoint was still blocked after "
                f"{OP_BOUND_S + PROCESS_SLACK_S}s (the op's bound plus the process's start-up)"
            )
        result = json.loads(out)
        assert result["seconds"] < OP_BOUND_S
        assert "timeout" in result["outcome"].lower(), result
    finally:
        silent.close()


@pytest.mark.timeout(60)
def test_write_through_to_a_silent_endpoint_never_blocks_dumps_or_close(
    unique_id: str, tmp_path: Path
) -> None:
    silent = SilentEndpoint()
    try:
        options = {**silent.options, "config_kwargs": S3_CONFIG}
        config = {
            "unique_id": unique_id,
            "shard_size": SHARD,
            "shards_per_block": 1,
            "tiers": [
                {"type": "posix", "path": str(tmp_path / "nvme")},
                {
                    "type": "fsspec",
                    "url": f"s3://ucm-test/{uuid.uuid4().hex}",
                    "storage_options": options,
                    "write": "through",
                },
            ],
        }
        block_ids = [block_id_of(b"through", i) for i in range(2)]
        shards = Shards(2)
        shards.fill(block_ids, 0)
        store = ucm.open(config)
        store.wait(store.dump_data(block_ids, 0, shards.pointers(2)))  # the top tier took them
        # Acknowledged while the write-through to the silent endpoint is still pending.
        assert store.stats()["write_queue_bytes"] > 0
        shards.poison()
        store.wait(store.load_data(block_ids, 0, shards.pointers(2)))
        assert [shards.data(i) for i in range(2)] == [payload(b, 0) for b in block_ids]
        started = time.monotonic()
        store.close()  # finishes (here: fails) the write-through within the request deadline
        close_s = time.monotonic() - started
        assert close_s < OP_BOUND_S, close_s
        stats = store.stats()
        assert stats.get("write_through_failures", 0) == 2, stats
    finally:
        silent.close()
