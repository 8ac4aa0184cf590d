"""Kill soak: rank processes share one ``buffer → posix`` stack while a controller SIGKILLs them.

``N`` rank processes run a mixed load / dump / touch / remove / lookup workload on the same
``unique_id``. Every shard written carries its own key and a generation (the monotonic clock at
dump time), and the rest of its bytes are derived from that header, so any byte a load returns
can be checked without knowing who wrote it: a wrong key, a torn mix of two writes, a stale or
half-written slot all fail the check. A controller SIGKILLs random ranks at random moments, and
on purpose while a rank owns a slot half-way through filling it and while a rank holds a bucket
lock (the native debug hook), then restarts them. Afterwards it checks that

- no operation ever outlived its bound and no buffer wait outlived ``wait_timeout_s``;
- every byte ever returned matched its key;
- once the survivors have closed, every slot's reference count is back to zero and no slot is
  leaked (detached, or claimed by nobody alive);
- the buffer keeps serving: a fresh rank loads every key byte-exact.

Ranks report through fixed-size record files written in place (two alternating copies, so a
kill in the middle of a write loses at most the latest update), never through pipes that a
killed process could leave half-written. ``python -m harness.soak --seconds 600`` (from the
repository root) runs the long form. This is a repository tool, not part of the wheel.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

REPOSITORY = Path(__file__).resolve().parents[1]
"""The checkout this harness lives in: rank processes import ``harness`` (and ``ucm``) from it."""
TEST_LIBRARY = REPOSITORY / "ucm" / "native" / "libucm_core_test.so"
"""The test build of the core (``pip install -e .`` builds it beside the release library): the
soak's fault injection and slot audits use its ``*_debug_*`` hooks, which the release library
does not export. ``UCM_NATIVE_LIB`` set by the caller wins; the rank processes inherit it."""
os.environ.setdefault("UCM_NATIVE_LIB", str(TEST_LIBRARY))


def _rank_environment() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPOSITORY), path) if p))


MAGIC = b"UCMSOAK1"
_HEADER = struct.Struct("<8s16sIIQ")  # magic, block id, shard, zero, generation
HEADER_BYTES = _HEADER.size
RECORD_BYTES = 4096
"""Each rank record copy is padded to this size; two copies alternate (see _RecordFile)."""
LOCK_TIMEOUT_S = 10.0
"""The native bucket-lock timeout (core-native/src/constants.zig buffer_lock_timeout_ns)."""
STOP_TIMEOUT_S = 30.0
READY_POLL_S = 0.05
"""How often the controller rereads a starting rank's record before stopping it."""
HOLD_REPLY_TIMEOUT_S = 5.0
KILL_MODES = ("random", "owner", "lock", "reader")
"""random: any moment; owner: owning a half-filled slot; lock: holding a bucket lock;
reader: holding a reference to a Ready slot (as while copying a hit out)."""

Key = tuple[bytes, int]


# ---- payloads ---------------------------------------------------------------------------------


def encode_payload(key: Key, generation: int, size: int) -> bytes:
    """The bytes of ``key`` written at ``generation``: a header naming both, then bytes derived
    from the header (so every byte depends on the key and the generation)."""
    block_id, shard = key
    if size < HEADER_BYTES:
        raise ValueError(f"shard size {size} is below the {HEADER_BYTES}-byte payload header")
    header = _HEADER.pack(MAGIC, block_id, shard, 0, generation)
    return header + hashlib.shake_256(header).digest(size - HEADER_BYTES)


def check_payload(key: Key, data: bytes, not_before_ns: int, not_after_ns: int) -> str:
    """Empty when ``data`` is a whole payload of ``key`` written between the two clock readings;
    otherwise what is wrong with it."""
    if len(data) < HEADER_BYTES:
        return f"{len(data)} bytes, shorter than the payload header"
    magic, block_id, shard, zero, generation = _HEADER.unpack_from(data)
    if magic != MAGIC or zero != 0:
        return f"no payload header (first bytes {data[:16].hex()})"
    if (block_id, shard) != key:
        return f"bytes of block {block_id.hex()} shard {shard}"
    if not not_before_ns <= generation <= not_after_ns:
        return f"generation {generation} outside [{not_before_ns}, {not_after_ns}]"
    if data[HEADER_BYTES:] != hashlib.shake_256(data[:HEADER_BYTES]).digest(
        len(data) - HEADER_BYTES
    ):
        return f"body does not match its header (generation {generation}): torn or corrupted"
    return ""


def block_id_of(prefix: bytes, index: int) -> bytes:
    """A 16-byte block id: ``prefix`` then the index."""
    return (prefix + index.to_bytes(8, "big")).rjust(16, b"\0")[-16:]


# ---- settings and stack -----------------------------------------------------------------------


@dataclass(frozen=True)
class SoakSettings:
    seconds: float = 60.0
    ranks: int = 4
    seed: int = 1
    shard_size: int = 16384
    shards_per_block: int = 4
    blocks: int = 64
    """Blocks in the shared key space (every rank works on the same ones)."""
    buffer_slots: int = 64
    reserved_slots: int = 16
    wait_timeout_s: float = 2.0
    """The buffer tier's ``wait_timeout_s``: the longest a rank waits on another rank's load."""
    kill_every_s: tuple[float, float] = (0.3, 1.2)
    """A kill happens every uniform(a, b) seconds."""
    hold_s: tuple[float, float] = (0.0, 0.4)
    """How long a rank holds a slot or a lock before it is killed."""
    restart_after_s: tuple[float, float] = (0.0, 0.3)
    workdir: str | None = None
    """Where the posix tier and the rank records go; a temporary directory when None."""
    write: str = "back"
    """The posix tier's write policy: ``back`` soaks the buffer's write-back debt (dirty slots,
    flushers killed mid-write, the last close), ``through`` the write-through queue."""
    min_kills_per_mode: int = 0
    """Keep running past ``seconds`` until every kill mode happened this often (goals: a busy
    machine gets more time, never a weaker run), up to ``seconds_max``."""
    min_loads_verified: int = 0
    min_dumps: int = 0
    min_removes: int = 0
    seconds_max: float | None = None
    """Hard end of the run when goals are set (None: ``seconds``); goals not met by then are a
    violation."""

    @property
    def op_timeout_s(self) -> float:
        """Bound on one operation: a buffer wait, a bucket-lock wait (the native lock timeout,
        reached only when a live process holds a lock), and slack for a loaded machine."""
        return self.wait_timeout_s + LOCK_TIMEOUT_S + 3.0

    def check(self) -> None:
        problems = []
        if not 1 <= self.ranks <= 64:
            problems.append(f"ranks={self.ranks} (expected 1 to 64)")
        if not self.seconds > 0:
            problems.append(f"seconds={self.seconds} (expected > 0)")
        if self.shard_size < HEADER_BYTES:
            problems.append(f"shard_size={self.shard_size} (expected >= {HEADER_BYTES})")
        if self.blocks < 2 or self.buffer_slots < 2 or self.shards_per_block < 1:
            problems.append("blocks, buffer_slots >= 2 and shards_per_block >= 1")
        if self.write not in ("back", "through"):
            problems.append(f"write={self.write!r} (expected 'back' or 'through')")
        if self.seconds_max is not None and self.seconds_max < self.seconds:
            problems.append(f"seconds_max={self.seconds_max} (expected >= seconds)")
        if problems:
            from ucm.errors import InvalidArgumentError

            raise InvalidArgumentError("soak settings not valid: " + "; ".join(problems))


def stack_config(settings: SoakSettings, unique_id: str, workdir: Path) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "shard_size": settings.shard_size,
        "shards_per_block": settings.shards_per_block,
        "tiers": [
            {
                "type": "buffer",
                "capacity": settings.buffer_slots * settings.shard_size,
                "reserved_slots": settings.reserved_slots,
                "wait_timeout_s": settings.wait_timeout_s,
            },
            {
                "type": "posix",
                "path": str(workdir / "nvme"),
                "lock_timeout": 5.0,
                "write": settings.write,
            },
        ],
    }


# ---- rank records -----------------------------------------------------------------------------


@dataclass
class RankRecord:
    """What one rank incarnation reports (written in place after every operation)."""

    rank: int = 0
    incarnation: int = 0
    pid: int = 0
    state: str = "starting"
    """starting | running | closed | failed"""
    op: str = ""
    op_started: float = 0.0
    """time.monotonic() (CLOCK_MONOTONIC, shared by every process) when ``op`` began."""
    ops: dict[str, int] = field(default_factory=dict)
    loads_verified: int = 0
    load_misses: int = 0
    load_errors: int = 0
    dumps_ok: int = 0
    dump_failures: int = 0
    removed: int = 0
    mismatches: int = 0
    longest_op_s: float = 0.0
    longest_op: str = ""
    longest_wait_s: float = 0.0
    wait_timeouts: int = 0
    task_timeouts: int = 0
    holds: int = 0
    error: str = ""
    fresh_verified: int = 0
    fresh_failures: int = 0
    buffer_bypassed: int = 0
    error_samples: list[str] = field(default_factory=list)
    """The first few load errors other than misses (what a rank saw, shortened)."""


class _RecordFile:
    """Two fixed-size copies written alternately with pwrite; the reader takes the newest copy
    that parses, so a write torn by SIGKILL loses only that update."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self._sequence = 0

    def write(self, record: RankRecord) -> None:
        self._sequence += 1
        raw = json.dumps({"seq": self._sequence, **asdict(record)}).encode()
        assert len(raw) < RECORD_BYTES, len(raw)
        os.pwrite(self._fd, raw.ljust(RECORD_BYTES, b" "), (self._sequence % 2) * RECORD_BYTES)

    @staticmethod
    def read(path: Path) -> RankRecord | None:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        best: dict[str, Any] | None = None
        for offset in (0, RECORD_BYTES):
            try:
                candidate = json.loads(raw[offset : offset + RECORD_BYTES])
            except ValueError:
                continue
            if isinstance(candidate, dict) and (best is None or candidate["seq"] > best["seq"]):
                best = candidate
        if best is None:
            return None
        best.pop("seq")
        return RankRecord(**best)


# ---- the rank process -------------------------------------------------------------------------


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs (passed as JSON on its command line)."""

    mode: str
    """work | verify"""
    rank: int
    incarnation: int
    local_rank_size: int
    stack: dict[str, Any]
    blocks: int
    seed: int
    start_ns: int
    record_path: str
    violations_path: str
    op_timeout_s: float


class _Rank:
    """The workload of one rank process."""

    def __init__(self, spec: RankSpec, requests: _Requests) -> None:
        import ucm

        self.spec = spec
        self.rng = random.Random(spec.seed * 1_000_003 + spec.rank * 1009 + spec.incarnation)
        self.record = RankRecord(rank=spec.rank, incarnation=spec.incarnation, pid=os.getpid())
        self.records = _RecordFile(Path(spec.record_path))
        self.records.write(self.record)
        self.store = ucm.open(spec.stack, device_id=spec.rank, local_rank_size=spec.local_rank_size)
        self.layout = self.store.layout
        self.size = self.layout.shard_size
        self.buffer: Any = self.store.tiers[0]
        self.block_ids = [block_id_of(b"soak", i) for i in range(spec.blocks)]
        self.memory = [ctypes.create_string_buffer(self.size) for _ in range(16)]
        self.requests = requests
        self.record.state = "running"
        self.records.write(self.record)

    def _note_buffer_waits(self) -> None:
        """The longest single wait on other ranks' slots, and the waits that ran out: the
        native queue measures them."""
        counters = self.buffer.queue.stats()
        self.record.longest_wait_s = counters["wait_ns_max"] / 1e9
        self.record.wait_timeouts = counters["wait_timeouts"]

    def violation(self, text: str) -> None:
        line = json.dumps({"rank": self.spec.rank, "pid": os.getpid(), "violation": text})
        fd = os.open(self.spec.violations_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    # -- operations ------------------------------------------------------------------------

    def _wait(self, task: Any) -> dict[Key, BaseException | str]:
        """Waits for a task within the op bound; returns its failures."""
        import concurrent.futures

        from ucm.errors import TaskError

        try:
            task.result(timeout=self.spec.op_timeout_s)
        except TaskError as error:
            return dict(error.failures)
        except concurrent.futures.TimeoutError:
            self.record.task_timeouts += 1
            self.violation(f"{task.kind} task did not finish within {self.spec.op_timeout_s}s")
            self.records.write(self.record)
            os._exit(3)  # a stuck task thread: report and let the controller restart us
        return {}

    def _random_key(self) -> Key:
        return self.rng.choice(self.block_ids), self.rng.randrange(self.layout.shards_per_block)

    def _pick(self, count: int) -> tuple[list[bytes], list[int]]:
        blocks = self.rng.sample(self.block_ids, count)
        shards = [self.rng.randrange(self.layout.shards_per_block) for _ in blocks]
        return blocks, shards

    def load(self, blocks: list[bytes], shards: list[int]) -> None:
        from ucm.errors import KeyMissingError

        memory = self.memory[: len(blocks)]
        for buffer in memory:
            ctypes.memset(buffer, 0xA5, self.size)  # poison: a load that writes nothing fails
        not_before = self.spec.start_ns
        failures = self._wait(
            self.store.load_data(blocks, shards, [[ctypes.addressof(m)] for m in memory])
        )
        now = time.monotonic_ns()
        for block_id, shard, buffer in zip(blocks, shards, memory, strict=True):
            failure = failures.get((block_id, shard))
            if failure is not None:
                if isinstance(failure, KeyMissingError):
                    self.record.load_misses += 1
                else:
                    self.record.load_errors += 1
                    if len(self.record.error_samples) < 3:
                        self.record.error_samples.append(str(failure)[:300])
                continue
            problem = check_payload((block_id, shard), buffer.raw, not_before, now)
            if problem:
                self.record.mismatches += 1
                self.violation(f"load of block {block_id.hex()} shard {shard} returned {problem}")
            else:
                self.record.loads_verified += 1

    def dump(self, blocks: list[bytes], shards: list[int]) -> None:
        memory = self.memory[: len(blocks)]
        generation = time.monotonic_ns()
        for block_id, shard, buffer in zip(blocks, shards, memory, strict=True):
            ctypes.memmove(
                buffer, encode_payload((block_id, shard), generation, self.size), self.size
            )
        failures = self._wait(
            self.store.dump_data(blocks, shards, [[ctypes.addressof(m)] for m in memory])
        )
        self.record.dumps_ok += len(blocks) - len(failures)
        self.record.dump_failures += len(failures)
        for cause in failures.values():
            sample = f"dump: {type(cause).__name__}: {cause}"[:200]
            if len(self.record.error_samples) < 5 and sample not in self.record.error_samples:
                self.record.error_samples.append(sample)

    def step(self) -> None:
        roll = self.rng.random()
        if roll < 0.5:
            kind = "load"
        elif roll < 0.75:
            kind = "dump"
        elif roll < 0.85:
            kind = "touch"
        elif roll < 0.95:
            kind = "remove"
        else:
            kind = "lookup"
        self.record.op, self.record.op_started = kind, time.monotonic()
        self.records.write(self.record)
        if kind == "load":
            self.load(*self._pick(self.rng.randint(1, 8)))
        elif kind == "dump":
            self.dump(*self._pick(self.rng.randint(1, 6)))
        elif kind == "touch":
            self.store.touch(self._pick(self.rng.randint(1, 8))[0])
        elif kind == "remove":
            force = self.rng.random() < 0.3
            self.record.removed += self.store.remove(self._pick(self.rng.randint(1, 2))[0], force)
        else:
            self.store.lookup(self._pick(self.rng.randint(1, 8))[0])
        if kind == "load":
            self._note_buffer_waits()
        elapsed = time.monotonic() - self.record.op_started
        if elapsed > self.record.longest_op_s:
            self.record.longest_op_s, self.record.longest_op = elapsed, kind
        self.record.ops[kind] = self.record.ops.get(kind, 0) + 1
        self.record.op = ""
        self.records.write(self.record)

    # -- holds: the controller kills us while we own a slot or hold a bucket lock -------------

    def _announce(self, what: str) -> None:
        os.write(1, (what + "\n").encode())

    def hold_slot(self) -> None:
        """Claims a missing key's slot (native Get: OWNER), writes half of its bytes, announces
        it and waits to be killed: ranks asking for the key meanwhile wait on the slot."""
        from ucm.native.buffer import GetResult

        core = self.buffer.core
        region = self.buffer.region
        bases = [region.segment_address(i) for i in range(core.geometry.segment_count)]
        for _ in range(32):
            key = (
                self.rng.choice(self.block_ids),
                self.rng.randrange(self.layout.shards_per_block),
            )
            got = core.get([key])
            if list(got.results) != [GetResult.OWNER]:
                core.release(got.held_slots())
                continue
            (address,) = core.slot_addresses(got.slots, bases)
            data = encode_payload(key, time.monotonic_ns(), self.size)
            ctypes.memmove(address, data, self.size // 2)  # half-written
            self.record.holds += 1
            self.records.write(self.record)
            self._announce("owning")
            time.sleep(60.0)
            raise AssertionError("the controller should have killed this rank")
        self._announce("hold-failed")

    def hold_reader(self) -> None:
        """Takes a reference to a Ready slot (a hit being copied out) and waits to be killed."""
        from ucm.native.buffer import GetResult

        core = self.buffer.core
        for _ in range(64):
            key = (
                self.rng.choice(self.block_ids),
                self.rng.randrange(self.layout.shards_per_block),
            )
            if core.lookup([key]) != [True]:
                continue
            got = core.get([key])
            if list(got.results) != [GetResult.HIT]:
                core.release(got.held_slots())  # an owner releasing Idle gives the slot up
                continue
            self.record.holds += 1
            self.records.write(self.record)
            self._announce("reading")
            time.sleep(60.0)
            raise AssertionError("the controller should have killed this rank")
        self._announce("hold-failed")

    def hold_lock(self) -> None:
        core = self.buffer.core
        core.debug_hold_lock(core.bucket_of(self.rng.choice(self.block_ids)))
        self.record.holds += 1
        self.records.write(self.record)
        self._announce("locked")
        time.sleep(60.0)
        raise AssertionError("the controller should have killed this rank")

    def run(self) -> None:
        while not self.requests.stop:
            hold, self.requests.hold = self.requests.hold, ""
            if hold == "owner":
                self.hold_slot()
            elif hold == "lock":
                self.hold_lock()
            elif hold == "reader":
                self.hold_reader()
            self.step()
        self.store.close()
        self.record.state = "closed"
        self.records.write(self.record)

    def verify(self) -> None:
        """A fresh rank: every key of the key space loads byte-exact or misses; fresh keys
        dumped now load back exactly; nothing is bypassed for want of a slot."""
        from ucm.errors import KeyMissingError

        spb = self.layout.shards_per_block
        batch = 8
        for shard in range(spb):
            for start in range(0, len(self.block_ids), batch):
                blocks = self.block_ids[start : start + batch]
                self.load(blocks, [shard] * len(blocks))
        self.record.fresh_verified = self.record.loads_verified
        fresh = [block_id_of(b"fresh", i) for i in range(self.buffer.geometry.slot_count_regular)]
        for start in range(0, len(fresh), batch):
            blocks = fresh[start : start + batch]
            self.dump(blocks, [0] * len(blocks))
            expected = [bytes(m.raw) for m in self.memory[: len(blocks)]]
            for m in self.memory[: len(blocks)]:
                ctypes.memset(m, 0, self.size)
            failures = self._wait(
                self.store.load_data(
                    blocks, 0, [[ctypes.addressof(m)] for m in self.memory[: len(blocks)]]
                )
            )
            for i, block_id in enumerate(blocks):
                failure = failures.get((block_id, 0))
                if failure is not None or self.memory[i].raw != expected[i]:
                    self.record.fresh_failures += 1
                    why = "different bytes" if failure is None else repr(failure)
                    if isinstance(failure, KeyMissingError):
                        why = f"a miss ({failure})"
                    self.violation(f"fresh rank: block {block_id.hex()} loaded back {why}")
                else:
                    self.record.fresh_verified += 1
        self.record.buffer_bypassed = int(self.buffer.stats()["bypassed"])
        self.store.close()
        self.record.state = "closed"
        self.records.write(self.record)


@dataclass
class _Requests:
    """What the controller asked for by signal (set by handlers installed before anything
    else, so a signal during start-up is never the default action, which would end us)."""

    stop: bool = False
    hold: str = ""


def rank_main(spec: RankSpec) -> int:
    """Entry point of a rank process (``python -m harness.soak rank SPEC_JSON``)."""
    requests = _Requests()

    def on_signal(signum: int, _frame: object) -> None:
        if signum == signal.SIGTERM:
            requests.stop = True
        else:  # the controller wrote which hold it wants next to the rank's hold file
            requests.hold = Path(f"{spec.record_path}.hold").read_text().strip()

    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, on_signal)
    rank: _Rank | None = None
    try:
        rank = _Rank(spec, requests)
        if spec.mode == "verify":
            rank.verify()
        else:
            rank.run()
        return 0
    except Exception as exc:
        record = rank.record if rank is not None else RankRecord(rank=spec.rank, pid=os.getpid())
        record.state, record.error = "failed", f"{type(exc).__name__}: {exc}"
        if rank is not None:
            rank.records.write(record)
        else:
            _RecordFile(Path(spec.record_path)).write(record)
        raise


# ---- the controller ---------------------------------------------------------------------------


@dataclass
class SlotAudit:
    """Every slot of the buffer, classified."""

    slots: int = 0
    free: int = 0
    ready: int = 0
    preallocated: int = 0
    abandoned: int = 0
    """Idle and unreferenced, not hung by Prealloc: left by an owner that died (its reference
    reclaimed) or gave up mid-fill. Not leaked: the next get of its key takes it over, and
    CLOCK may take it for another key (``test_owner_sigkilled_with_nobody_waiting_leaves_a_
    takeover_able_slot``). A kill soak that ends right after an owner kill leaves one."""
    problems: list[str] = field(default_factory=list)


@dataclass
class SoakReport:
    settings: dict[str, Any]
    seconds: float = 0.0
    kills: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KILL_MODES, 0))
    restarts: int = 0
    incarnations: int = 0
    ops: dict[str, int] = field(default_factory=dict)
    loads_verified: int = 0
    load_misses: int = 0
    load_errors: int = 0
    dumps_ok: int = 0
    dump_failures: int = 0
    mismatches: int = 0
    longest_op_s: float = 0.0
    longest_op: str = ""
    longest_wait_s: float = 0.0
    wait_timeouts: int = 0
    task_timeouts: int = 0
    buffer_counters: dict[str, int] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)
    reclaimed_holders: int = 0
    """Dead processes whose references ``reclaim_dead`` dropped after the survivors closed."""
    reclaimed_refs: int = 0
    held_by_killed_before_fresh: list[str] = field(default_factory=list)
    audit: SlotAudit = field(default_factory=SlotAudit)
    fresh_verified: int = 0
    fresh_failures: int = 0
    fresh_bypassed: int = 0
    debt_at_end: int = 0
    """Dirty slots (write-back debt) when every rank had stopped, before the last close."""
    debt_written: int = 0
    """Of those, shards found on posix byte-exact after the last close wrote the debt down."""
    goals_met: bool = True
    violations: list[str] = field(default_factory=list)

    @property
    def kills_total(self) -> int:
        return sum(self.kills.values())

    @property
    def ok(self) -> bool:
        return not self.violations


@dataclass
class _Proc:
    rank: int
    incarnation: int
    process: subprocess.Popen[bytes]
    record_path: Path
    stderr_path: Path
    stopping: bool = False


@dataclass
class SoakProgress:
    elapsed_s: float
    seconds: float
    kills: int
    restarts: int
    loads_verified: int
    longest_op_s: float
    dumps: int = 0
    removes: int = 0


class _Controller:
    def __init__(
        self,
        settings: SoakSettings,
        workdir: Path,
        progress: Callable[[SoakProgress], None] | None,
    ) -> None:
        self.settings = settings
        self.workdir = workdir
        self.progress = progress
        self.rng = random.Random(settings.seed)
        self.unique_id = f"soak-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.stack = stack_config(settings, self.unique_id, workdir)
        self.start_ns = time.monotonic_ns()
        self.report = SoakReport(settings=asdict(settings))
        self.procs: dict[int, _Proc] = {}
        self.finished: list[_Proc] = []
        self.restart_at: dict[int, float] = {}
        self.incarnations = 0
        self.kill_attempts = 0
        self.violations_path = workdir / "violations.jsonl"

    def spawn(self, rank: int, mode: str = "work") -> _Proc:
        """Starts a rank process (``python -m harness.soak rank``)."""
        self.incarnations += 1
        record_path = self.workdir / f"rank{rank}-{self.incarnations}.rec"
        stderr_path = self.workdir / f"rank{rank}-{self.incarnations}.stderr"
        spec = RankSpec(
            mode=mode,
            rank=rank,
            incarnation=self.incarnations,
            local_rank_size=self.settings.ranks,
            stack=self.stack,
            blocks=self.settings.blocks,
            seed=self.settings.seed,
            start_ns=self.start_ns,
            record_path=str(record_path),
            violations_path=str(self.violations_path),
            op_timeout_s=self.settings.op_timeout_s,
        )
        with open(stderr_path, "wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", "harness.soak", "rank", json.dumps(asdict(spec))],
                env=_rank_environment(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr,
            )
        proc = _Proc(rank, self.incarnations, process, record_path, stderr_path)
        self.procs[rank] = proc
        return proc

    def _reply(self, proc: _Proc, timeout_s: float) -> str:
        """The next line a rank announces on stdout ('' if none within the timeout)."""
        stdout = proc.process.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout_s
        data = b""
        while not data.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([stdout], [], [], remaining)[0]:
                return ""
            chunk = os.read(stdout.fileno(), 64)
            if not chunk:
                return ""
            data += chunk
        return data.decode().strip().splitlines()[-1]

    def kill(self, proc: _Proc) -> None:
        """SIGKILLs a rank at a random moment, or while it owns a slot or holds a lock."""
        # Modes in turn (the moments are random), so even a short run covers each of them.
        mode = KILL_MODES[self.kill_attempts % len(KILL_MODES)]
        self.kill_attempts += 1
        if mode != "random":
            Path(f"{proc.record_path}.hold").write_text(mode)
            proc.process.send_signal(signal.SIGUSR1)
            reply = self._reply(proc, HOLD_REPLY_TIMEOUT_S)
            if reply in ("owning", "locked", "reading"):
                time.sleep(self.rng.uniform(*self.settings.hold_s))
            else:
                mode = "random"  # busy past the reply timeout or no claimable key: plain kill
        proc.process.kill()
        proc.process.wait(STOP_TIMEOUT_S)
        self.report.kills[mode] += 1
        self._retire(proc)
        self.restart_at[proc.rank] = time.monotonic() + self.rng.uniform(
            *self.settings.restart_after_s
        )

    def _retire(self, proc: _Proc) -> None:
        if proc.process.stdout is not None:
            proc.process.stdout.close()
        self.finished.append(proc)
        if self.procs.get(proc.rank) is proc:
            del self.procs[proc.rank]

    def _stderr_tail(self, proc: _Proc) -> str:
        text = proc.stderr_path.read_text(errors="replace").strip()
        return text.splitlines()[-1] if text else "(no stderr)"

    def supervise(self) -> None:
        """Reaps ranks that exited on their own and watches for operations past their bound."""
        now = time.monotonic()
        for proc in list(self.procs.values()):
            code = proc.process.poll()
            if code is not None:
                self.report.violations.append(
                    f"rank {proc.rank} (pid {proc.process.pid}) exited by itself with code "
                    f"{code}: {self._stderr_tail(proc)}"
                )
                self._retire(proc)
                self.restart_at[proc.rank] = now
                continue
            record = _RecordFile.read(proc.record_path)
            if record and record.op and now - record.op_started > self.settings.op_timeout_s:
                self.report.violations.append(
                    f"rank {proc.rank} (pid {proc.process.pid}): {record.op} running for "
                    f"{now - record.op_started:.1f}s, past its {self.settings.op_timeout_s}s bound"
                )
                proc.process.kill()
                proc.process.wait(STOP_TIMEOUT_S)
                self._retire(proc)
                self.restart_at[proc.rank] = now
        for rank, when in list(self.restart_at.items()):
            if now >= when:
                del self.restart_at[rank]
                self.spawn(rank)
                self.report.restarts += 1

    def snapshot(self) -> SoakProgress:
        verified, longest, dumps, removes = 0, 0.0, 0, 0
        for proc in [*self.finished, *self.procs.values()]:
            record = _RecordFile.read(proc.record_path)
            if record is not None:
                verified += record.loads_verified
                longest = max(longest, record.longest_op_s)
                dumps += record.ops.get("dump", 0)
                removes += record.ops.get("remove", 0)
        return SoakProgress(
            elapsed_s=time.monotonic() - self.start_ns / 1e9,
            seconds=self.settings.seconds,
            kills=self.report.kills_total,
            restarts=self.report.restarts,
            loads_verified=verified,
            longest_op_s=longest,
            dumps=dumps,
            removes=removes,
        )

    def goals_met(self) -> bool:
        """Whether the run did at least the work its settings ask for."""
        settings = self.settings
        if any(self.report.kills[mode] < settings.min_kills_per_mode for mode in KILL_MODES):
            return False
        if not (settings.min_loads_verified or settings.min_dumps or settings.min_removes):
            return True
        progress = self.snapshot()
        return (
            progress.loads_verified >= settings.min_loads_verified
            and progress.dumps >= settings.min_dumps
            and progress.removes >= settings.min_removes
        )

    def _wait_running(self, proc: _Proc, deadline: float) -> bool:
        """Whether the rank reported it opened the store (or exited) before ``deadline``. Its
        signal handlers are installed before its first record: until then, SIGTERM would end
        it with the default action in the middle of Python's start-up (seen on a busy CI)."""
        for _ in range(int(STOP_TIMEOUT_S / READY_POLL_S) + 1):
            record = _RecordFile.read(proc.record_path)
            if record is not None and record.state != "starting":
                return True
            if proc.process.poll() is not None:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(READY_POLL_S)
        return False

    def stop_all(self) -> None:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs.values():
            if not self._wait_running(proc, deadline):
                self.report.violations.append(
                    f"rank {proc.rank} (pid {proc.process.pid}) did not open the store within "
                    f"{STOP_TIMEOUT_S}s of its start"
                )
            proc.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in list(self.procs.values()):
            try:
                code = proc.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.report.violations.append(
                    f"rank {proc.rank} did not stop within {STOP_TIMEOUT_S}s of SIGTERM"
                )
                proc.process.kill()
                code = proc.process.wait(STOP_TIMEOUT_S)
            if code != 0:
                self.report.violations.append(
                    f"rank {proc.rank} exited with {code} on stop: {self._stderr_tail(proc)}"
                )
            self._retire(proc)

    def collect(self) -> None:
        report = self.report
        for proc in self.finished:
            record = _RecordFile.read(proc.record_path)
            if record is None:
                continue
            report.incarnations += 1
            for kind, count in record.ops.items():
                report.ops[kind] = report.ops.get(kind, 0) + count
            report.loads_verified += record.loads_verified
            report.load_misses += record.load_misses
            report.load_errors += record.load_errors
            report.dumps_ok += record.dumps_ok
            report.dump_failures += record.dump_failures
            report.mismatches += record.mismatches
            report.wait_timeouts += record.wait_timeouts
            report.task_timeouts += record.task_timeouts
            if record.longest_op_s > report.longest_op_s:
                report.longest_op_s, report.longest_op = record.longest_op_s, record.longest_op
            report.longest_wait_s = max(report.longest_wait_s, record.longest_wait_s)
            for sample in record.error_samples:
                if len(report.error_samples) < 10 and sample not in report.error_samples:
                    report.error_samples.append(sample)
            if record.state == "failed":
                report.violations.append(
                    f"rank {record.rank} (pid {record.pid}) failed: {record.error}"
                )
        if self.violations_path.exists():
            for line in self.violations_path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)
                    report.violations.append(f"rank {entry['rank']}: {entry['violation']}")
        if report.longest_op_s > self.settings.op_timeout_s:
            report.violations.append(
                f"an operation ({report.longest_op}) took {report.longest_op_s:.2f}s, past its "
                f"{self.settings.op_timeout_s}s bound"
            )
        # A wait ends at its timeout plus at most one futex slice (100 ms) and scheduling.
        wait_bound = self.settings.wait_timeout_s + 1.0
        if report.longest_wait_s > wait_bound:
            report.violations.append(
                f"a buffer wait took {report.longest_wait_s:.2f}s, past wait_timeout_s="
                f"{self.settings.wait_timeout_s} (+1s)"
            )

    def run_fresh(self) -> None:
        proc = self.spawn(0, mode="verify")
        try:
            code = proc.process.wait(120.0)
        except subprocess.TimeoutExpired:
            proc.process.kill()
            proc.process.wait(STOP_TIMEOUT_S)
            code = -1
            self.report.violations.append("the fresh rank did not finish within 120s")
        self._retire(proc)
        record = _RecordFile.read(proc.record_path)
        if code != 0 or record is None or record.state != "closed":
            self.report.violations.append(
                f"the fresh rank exited with {code}: "
                f"{record.error if record else self._stderr_tail(proc)}"
            )
        if record is not None:
            self.report.fresh_verified = record.fresh_verified
            self.report.fresh_failures = record.fresh_failures
            self.report.fresh_bypassed = record.buffer_bypassed
            self.report.mismatches += record.mismatches
            if record.buffer_bypassed:
                self.report.violations.append(
                    f"the fresh rank bypassed the buffer for {record.buffer_bypassed} key(s): "
                    "no free slot (leaked references)"
                )


def audit_slots(core: Any, alive: Callable[[int], bool] = lambda pid: False) -> SlotAudit:
    """Classifies every slot; ``problems`` lists each held, detached or abandoned one."""
    from ucm.native.buffer import DETACHED, State

    audit = SlotAudit(slots=core.geometry.slot_count_total)
    for slot in range(audit.slots):
        info = core.slot_info(slot)
        where = f"slot {slot} (block {info.block_id.hex()} shard {info.shard_index})"
        if info.refcount:
            owner = ""
            if info.state is State.IDLE and info.owner_pid:
                living = "alive" if alive(info.owner_pid) else "dead"
                owner = f", claimed by pid {info.owner_pid} ({living})"
            audit.problems.append(
                f"{where}: refcount {info.refcount}, state {info.state.name}{owner}"
            )
        elif info.bucket is None:
            audit.free += 1
        elif info.bucket == DETACHED:
            audit.problems.append(f"{where}: detached with refcount 0 (never freed)")
        elif info.state is State.READY:
            audit.ready += 1
        elif info.state is State.IDLE and info.preallocated:
            audit.preallocated += 1
        elif info.state is State.IDLE:
            audit.abandoned += 1
        else:
            audit.problems.append(
                f"{where}: on its chain in state {info.state.name} with nobody holding it"
            )
    return audit


def _dirty_keys(core: Any) -> list[Key]:
    """Every key whose slot holds write-back debt now."""
    debt: list[Key] = []
    for slot in range(core.geometry.slot_count_total):
        info = core.slot_info(slot)
        if info.dirty:
            debt.append((info.block_id, info.shard_index))
    return debt


def _on_posix(controller: _Controller, debt: list[Key]) -> int:
    """How many of the debt's keys the posix directory holds with a valid payload of theirs,
    opened alone after the buffer is gone."""
    import ucm

    stack = dict(controller.stack)
    stack["unique_id"] = f"{controller.unique_id}-audit"
    stack["tiers"] = [{k: v for k, v in controller.stack["tiers"][1].items() if k != "write"}]
    keys = debt
    size = controller.settings.shard_size
    with ucm.open(stack) as store:
        tier = store.tiers[0]
        memory = [memoryview(bytearray(size)) for _ in keys]
        outcomes = tier.load(keys, [[view] for view in memory])
    now_ns = time.monotonic_ns()
    return sum(
        1
        for key, view, outcome in zip(keys, memory, outcomes, strict=True)
        if outcome is None and not check_payload(key, bytes(view), controller.start_ns, now_ns)
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def reclaim_dead_references(core: Any) -> tuple[int, int] | None:
    """Drops every reference held by a dead process (``BufferCore.reclaim_dead``); returns
    (holders freed, references dropped), or None when this native build lacks the call."""
    reclaim = getattr(core, "reclaim_dead", None)
    if reclaim is None:
        return None
    report = reclaim()
    return int(report.holders), int(report.refs)


def run_soak(
    settings: SoakSettings, progress: Callable[[SoakProgress], None] | None = None
) -> SoakReport:
    """Runs the kill soak for ``settings.seconds`` and returns what it saw."""
    import ucm
    from ucm.fieldtypes import SECONDS_MAX
    from ucm.native import segments

    settings.check()
    workdir = Path(settings.workdir or tempfile.mkdtemp(prefix="ucm-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    controller = _Controller(settings, workdir, progress)
    report = controller.report
    started = time.monotonic()
    # The controller keeps the buffer open (and serves its segments) for the whole run, and
    # inspects every slot at the end.
    # It is no rank: its own background flusher stays off, so the slot audit at the end never
    # meets a reference it holds mid-flush (the ranks' flushers run, and its close pays).
    observer_stack = json.loads(json.dumps(controller.stack))
    observer_stack["tiers"][0]["flush_interval_s"] = SECONDS_MAX  # a day: never, in a soak
    observer = ucm.open(observer_stack, device_id=0, local_rank_size=settings.ranks)
    try:
        top: Any = observer.tiers[0]
        core = top.core
        for rank in range(settings.ranks):
            controller.spawn(rank)
        deadline = started + settings.seconds
        hard_deadline = started + (settings.seconds_max or settings.seconds)
        next_kill = started + controller.rng.uniform(*settings.kill_every_s)
        next_progress = started
        next_goal_check = deadline
        while True:
            now = time.monotonic()
            if now >= hard_deadline:
                break
            if now >= next_goal_check:  # past `seconds`: stop once the goals are met
                if controller.goals_met():
                    break
                next_goal_check = now + 0.5
            controller.supervise()
            now = time.monotonic()
            if now >= next_kill and controller.procs:
                controller.kill(controller.rng.choice(list(controller.procs.values())))
                next_kill = time.monotonic() + controller.rng.uniform(*settings.kill_every_s)
            if progress is not None and now >= next_progress:
                progress(controller.snapshot())
                next_progress = now + 0.5
            time.sleep(0.02)
        for rank in list(controller.restart_at):
            del controller.restart_at[rank]
            controller.spawn(rank)  # every rank stops from a running state
            report.restarts += 1
        controller.stop_all()  # each rank once it has opened the store
        report.goals_met = controller.goals_met()
        if not report.goals_met:
            progress_now = controller.snapshot()
            report.violations.append(
                f"the run did not reach its goals in {hard_deadline - started:.0f}s: kills "
                f"{report.kills}, loads verified {progress_now.loads_verified}, dumps "
                f"{progress_now.dumps}, removes {progress_now.removes}"
            )
        controller.collect()
        reclaimed = reclaim_dead_references(core)
        if reclaimed is not None:
            report.reclaimed_holders, report.reclaimed_refs = reclaimed
        before = audit_slots(core, _pid_alive)
        report.held_by_killed_before_fresh = before.problems
        controller.run_fresh()
        report.audit = audit_slots(core, _pid_alive)
        report.violations += [f"leaked after the run: {p}" for p in report.audit.problems]
        report.buffer_counters = dict(core.stats())
        debt = _dirty_keys(core)
        report.debt_at_end = len(debt)
        if report.mismatches:
            report.violations.append(f"{report.mismatches} load(s) returned bytes of another key")
        if report.loads_verified == 0:
            report.violations.append("no load was verified: the workload did not run")
    finally:
        for proc in list(controller.procs.values()):
            proc.process.kill()
            proc.process.wait(STOP_TIMEOUT_S)
            controller._retire(proc)
        try:
            observer.close()  # the last process of the buffer: it writes the debt down
        except Exception as exc:
            report.violations.append(f"the last close failed: {exc}")
        segments.unlink(controller.unique_id)
    if report.debt_at_end:
        report.debt_written = _on_posix(controller, debt)
        if report.debt_written != report.debt_at_end:
            report.violations.append(
                f"write-back debt lost at the last close: {report.debt_at_end} dirty shard(s), "
                f"{report.debt_written} on posix afterwards"
            )
    if settings.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    report.seconds = time.monotonic() - started
    if progress is not None:
        progress(controller.snapshot())
    return report


# ---- presentation (python -m harness.soak) ------------------------------------------------------


def render(report: SoakReport) -> Iterator[str]:
    """The report as lines of text."""
    s = report.settings
    yield (
        f"{s['ranks']} ranks, {report.seconds:.0f}s, buffer {s['buffer_slots']}+"
        f"{s['reserved_slots']} slots of {s['shard_size']} B over posix, "
        f"{s['blocks']}x{s['shards_per_block']} keys"
    )
    kills = ", ".join(f"{mode} {count}" for mode, count in report.kills.items())
    yield f"kills survived: {report.kills_total} ({kills}); restarts {report.restarts}"
    ops = ", ".join(f"{kind} {count}" for kind, count in sorted(report.ops.items()))
    yield f"operations: {ops}"
    yield (
        f"loads verified byte-exact: {report.loads_verified} shards (misses "
        f"{report.load_misses}, errors {report.load_errors}); mismatches {report.mismatches}"
    )
    for sample in report.error_samples:
        yield f"  error seen: {sample}"
    yield f"dumps: {report.dumps_ok} shards ok, {report.dump_failures} failed"
    yield (
        f"longest operation {report.longest_op_s:.3f}s ({report.longest_op}); longest buffer "
        f"wait {report.longest_wait_s:.3f}s (wait_timeout_s {s['wait_timeout_s']})"
    )
    counters = report.buffer_counters
    yield (
        f"timeouts hit: {report.wait_timeouts} buffer waits, {report.task_timeouts} tasks; "
        f"takeovers {counters.get('takeovers', 0)}, lock recoveries "
        f"{counters.get('lock_recoveries', 0)}"
    )
    yield (
        f"after the survivors closed: reclaim_dead freed {report.reclaimed_holders} dead "
        f"holder(s) and {report.reclaimed_refs} reference(s); slots still held: "
        f"{len(report.held_by_killed_before_fresh)}"
    )
    yield (
        f"fresh rank: {report.fresh_verified} shards byte-exact, {report.fresh_failures} "
        f"failed, {report.fresh_bypassed} bypassed"
    )
    yield (
        f"write-back debt at the end: {report.debt_at_end} dirty shard(s), "
        f"{report.debt_written} on posix after the last close"
    )
    audit = report.audit
    yield (
        f"slots at the end: {audit.slots} ({audit.free} free, {audit.ready} ready, "
        f"{audit.preallocated} preallocated, {audit.abandoned} abandoned, "
        f"{len(audit.problems)} leaked)"
    )
    yield "result: " + ("ok" if report.ok else f"{len(report.violations)} violation(s)")


def soak_command(
    seconds: Annotated[
        float, typer.Option(min=1, help="How long the ranks run and get killed.")
    ] = 60.0,
    ranks: Annotated[
        int, typer.Option(min=1, max=64, help="Rank processes sharing the buffer.")
    ] = 4,
    seed: Annotated[int, typer.Option(help="Seed of the kill schedule and the workloads.")] = 1,
    workdir: Annotated[
        Path | None, typer.Option(help="Keep the posix tier and rank records here.")
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the report as JSON here.")
    ] = None,
    min_loads_verified: Annotated[
        int,
        typer.Option(
            min=0,
            help="Keep running past --seconds until this many loads were verified byte-exact "
            "(a busy machine gets more time, never a weaker run), up to --seconds-max.",
        ),
    ] = 0,
    seconds_max: Annotated[
        float | None,
        typer.Option(min=1, help="Hard end of a run with goals (default: --seconds)."),
    ] = None,
) -> None:
    """Kill soak: ranks share a buffer over posix while random ranks are SIGKILLed; checks that
    nothing hangs, every byte matches its key and no slot leaks (exit 1 on any violation)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    settings = SoakSettings(
        seconds=seconds,
        ranks=ranks,
        seed=seed,
        workdir=str(workdir) if workdir else None,
        min_loads_verified=min_loads_verified,
        seconds_max=seconds_max,
    )
    from ucm.errors import InvalidArgumentError

    try:
        settings.check()
    except InvalidArgumentError as exc:
        raise typer.BadParameter(str(exc)) from None
    with Progress(
        TextColumn("[bold]soak"),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[line]}"),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("soak", total=seconds, line="starting ranks")

        def show(p: SoakProgress) -> None:
            line = (
                f"kills {p.kills}, restarts {p.restarts}, loads verified {p.loads_verified}, "
                f"longest op {p.longest_op_s:.2f}s"
            )
            bar.update(task, completed=min(p.elapsed_s, p.seconds), line=line)

        report = run_soak(settings, progress=show)
    for line in render(report):
        console.print(line, highlight=False, soft_wrap=True)
    for violation in report.violations:
        console.print(f"[red]violation:[/red] {violation}", highlight=False, soft_wrap=True)
    if json_out is not None:
        json_out.write_text(json.dumps(asdict(report), indent=2))
    if not report.ok:
        raise typer.Exit(1)


app = typer.Typer(
    name="python -m harness.soak", add_completion=False, pretty_exceptions_enable=False
)
app.command()(soak_command)


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.soak [--seconds ...]`` runs the soak; ``rank SPEC_JSON`` is one of its
    rank processes (internal)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["rank"]:
        parser = argparse.ArgumentParser(prog="python -m harness.soak rank")
        parser.add_argument("spec")
        return rank_main(RankSpec(**json.loads(parser.parse_args(args[1:]).spec)))
    app(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
