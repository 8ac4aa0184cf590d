"""The promises, checked together: a model-based (hypothesis stateful) test of random stacks and
random operation sequences against a reference model.

A run draws a stack (a CacheBuffer or none; posix and fsspec tiers with every ``write:`` mode,
``admit:`` policy, lossless codec and namespace byte quota), then drives one engine-like user
through random operations: dump, load, reset (the engines' reset epoch), purge, forced remove,
close and reopen (the buffer is lost with the last rank), and eviction pressure (a small buffer,
small tier capacities). After every step the invariants hold:

- no block dumped before the last reset is ever served (and a reopened engine reads the reset
  epoch it left, never a lower one, while a tier holds blocks of the epochs before);
- no purged or force-removed block is ever served;
- no namespace is served another namespace's block;
- every byte served equals what was dumped under that id;
- nothing the docs promise to keep is lost: a block dumped into a stack whose lower tier takes
  every write (``write: through`` or ``back``, ``admit: always``, no capacity, no quota) is a hit
  after a close and a reopen, unless it was removed, purged or reset since.

Each served block's bytes name the namespace, epoch, block and removal generation they were
dumped under, so a stale, foreign or resurrected block is told apart from the right one.

``tests/reliability/test_invariants.py`` runs a CI-sized number of examples;
``python -m harness.invariants --minutes N`` runs seeded examples until N minutes are up and
prints the steps and seeds it covered.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec  # type: ignore[import-untyped]
import hypothesis.strategies as st
import yaml
from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import ucm
from ucm.errors import TaskError
from ucm.integration.keys import Epochs, EpochState

STALL_S = 0.1
"""How long a stalling tier takes to write one object."""


class StallingFileSystem(LocalFileSystem):  # type: ignore[misc]
    """``ucmstall://``: local files whose every write takes :data:`STALL_S` (a slow tier, so
    that writes are in flight while other operations run)."""

    protocol = ("ucmstall",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["auto_mkdir"] = True  # as the fsspec tier asks of file://
        super().__init__(*args, **kwargs)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        path = str(path)
        if path.startswith("ucmstall://"):
            path = path[len("ucmstall://") :]
        return super()._strip_protocol(path)

    def pipe_file(self, path: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(STALL_S)
        return super().pipe_file(path, value, *args, **kwargs)


fsspec.register_implementation("ucmstall", StallingFileSystem, clobber=True)

SHARD_BYTES = 4096
BLOCKS = 6
"""Block numbers a run uses (per namespace and epoch)."""
NAMESPACES = ("default", "tenant-a", "tenant-b")
CLI_PURGES_MAX = 1
"""``ucm purge`` runs per example (each starts a Python process)."""
CLI_TIMEOUT_S = 300
KILLS_MAX = 1
"""Rank processes killed per example (each starts a Python process)."""


@dataclass
class Stats:
    """What the runs covered (the harness prints it)."""

    runs: int = 0
    steps: int = 0
    served: int = 0
    missed: int = 0
    reopens: int = 0
    resets: int = 0
    purges: int = 0
    removes: int = 0
    cli_purges: int = 0
    kills: int = 0
    damaged: int = 0
    violations: list[str] = field(default_factory=list)


STATS = Stats()


def tier_options() -> st.SearchStrategy[dict[str, Any]]:
    """One lower tier's policy keys (its type and place are added by the stack)."""
    return st.fixed_dictionaries(
        {
            "type": st.sampled_from(["posix", "fsspec"]),
            "write": st.sampled_from(["through", "back"]),
            "admit": st.sampled_from(["always", {"after_reuse": 1}, {"min_residency_ms": 50}]),
            "codec": st.sampled_from(["none", "lz4", "zstd"]),
            "capacity": st.sampled_from([None, None, 6 * SHARD_BYTES]),
            "quota": st.sampled_from([None, None, 3 * SHARD_BYTES]),
            "stall": st.sampled_from([False, False, True]),
        }
    )


def stack_options() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "buffer_slots": st.sampled_from([None, 4, 16, 64]),
            "tiers": st.lists(tier_options(), min_size=0, max_size=2),
        }
    ).filter(lambda options: options["buffer_slots"] is not None or options["tiers"])


def build_stack(options: dict[str, Any], root: Path) -> tuple[dict[str, Any], bool]:
    """The stack of ``options`` under ``root``, and whether a lower tier keeps every dump (the
    "nothing promised is lost" check applies)."""
    tiers: list[dict[str, Any]] = []
    quotas: dict[str, int] = {}
    keeps_all = False
    buffered = options["buffer_slots"] is not None
    if buffered:
        tiers.append({"type": "buffer", "capacity": options["buffer_slots"] * SHARD_BYTES})
    for index, tier in enumerate(options["tiers"]):
        name = f"t{index}"
        spec: dict[str, Any] = {"type": tier["type"], "name": name, "codec": tier["codec"]}
        if tier["type"] == "posix":
            spec["path"] = str(root / name)
        else:
            scheme = "ucmstall" if tier["stall"] else "file"
            spec["url"] = f"{scheme}://{root / name}"
        if tier["capacity"] is not None:
            spec["capacity"] = tier["capacity"]
        if buffered:  # admission and write-back need a CacheBuffer above
            spec["write"] = tier["write"]
            spec["admit"] = tier["admit"]
        if tier["quota"] is not None:
            quotas[name] = tier["quota"]
        # A `write: back` tier below another lower tier gets only what that one evicts.
        takes_every_dump = index == 0 or spec.get("write", "through") == "through"
        keeps_all = keeps_all or (
            takes_every_dump
            and spec.get("admit", "always") == "always"
            and tier["capacity"] is None
            and tier["quota"] is None
        )
        tiers.append(spec)
    stack: dict[str, Any] = {
        "unique_id": f"inv-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD_BYTES,
        "shards_per_block": 1,
        "tiers": tiers,
    }
    if quotas:
        stack["quotas"] = {"others": {"tiers": quotas}}
    return stack, keeps_all


def payload(namespace: str, epoch: int, number: int, generation: int) -> bytes:
    """The bytes of one dump: they name what they were dumped under."""
    seed = f"{namespace}:{epoch}:{number}:{generation}".encode()
    digest = hashlib.blake2b(seed, digest_size=64).digest()
    return (digest * (SHARD_BYTES // len(digest) + 1))[:SHARD_BYTES]


class Promises(RuleBasedStateMachine):
    """One run: a stack, one engine-like user of it, and the reference model."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="ucm-invariants-"))
        self.store: ucm.Store | None = None
        self.epochs: EpochState | None = None
        self.base = hashlib.blake2b(uuid.uuid4().bytes, digest_size=16).digest()
        self.epoch = 0
        """The model's epoch: resets done so far."""
        self.generation: dict[tuple[str, int], int] = {}
        """(namespace, block) -> removals of it so far (a purge counts for every block)."""
        self.live: dict[tuple[str, int, int], bytes] = {}
        """(namespace, epoch, block) -> the bytes its last dump holds, while not removed."""
        self.maybe: dict[tuple[str, int, int], bytes] = {}
        """Blocks whose dump failed or whose rank was killed: they may be served (byte-exact),
        need not be."""
        self.stack: dict[str, Any] = {}
        self.cli_purges = 0
        self.kills = 0
        self.lower_roots: list[Path] = []
        """The directories of the lower tiers (each a posix path or a file:// fsspec url)."""
        self.corrupted = False
        self.evicts_below = False
        self.keeps_all = False
        self.buffered = False
        STATS.runs += 1

    # -- the user ------------------------------------------------------------------------------

    def _open(self) -> None:
        self.store = ucm.open(self.stack, device_id=0, local_rank_size=1)
        self.epochs = EpochState(Epochs(self.base), self.store)
        read = self.epochs.start()
        if read is not None and read != self.epoch:
            self._violation(f"the engine reopened in epoch {read}, the model is in {self.epoch}")

    def _id(self, number: int, epoch: int | None = None) -> bytes:
        epoch = self.epoch if epoch is None else epoch
        return hashlib.blake2b(f"{epoch}:{number}".encode(), key=self.base, digest_size=16).digest()

    def _violation(self, what: str) -> None:
        STATS.violations.append(what)
        raise AssertionError(f"promise broken: {what} (stack {self.stack})")

    @initialize(options=stack_options())
    def start(self, options: dict[str, Any]) -> None:
        self.stack, self.keeps_all = build_stack(options, self.root)
        self.evicts_below = any(
            "capacity" in tier for tier in self.stack["tiers"] if tier["type"] != "buffer"
        ) or bool(self.stack.get("quotas"))
        self.lower_roots = [
            self.root / tier["name"] for tier in self.stack["tiers"] if tier["type"] != "buffer"
        ]
        self.buffered = options["buffer_slots"] is not None
        self._open()

    @rule(
        namespace=st.sampled_from(NAMESPACES),
        numbers=st.lists(st.integers(0, BLOCKS - 1), min_size=1, max_size=BLOCKS, unique=True),
    )
    def dump(self, namespace: str, numbers: list[int]) -> None:
        assert self.store is not None
        data = [
            bytearray(payload(namespace, self.epoch, n, self.generation.get((namespace, n), 0)))
            for n in numbers
        ]
        addresses = [[ctypes.addressof((ctypes.c_char * SHARD_BYTES).from_buffer(d))] for d in data]
        ids = [self._id(n) for n in numbers]
        task = self.store.dump_data(ids, [0] * len(ids), addresses, namespace=namespace)
        failed: set[bytes] = set()
        try:
            self.store.wait(task)
        except TaskError as exc:
            failed = {block_id for block_id, _ in exc.failures}
            if os.environ.get("UCM_INVARIANTS_DEBUG"):
                print(f"dump failed: {exc}", file=sys.stderr)
        for number, block_id, shard in zip(numbers, ids, data, strict=True):
            key = (namespace, self.epoch, number)
            if block_id in failed:  # it may have landed somewhere all the same
                if key not in self.live:
                    self.maybe[key] = bytes(shard)
            else:
                self.live[key] = bytes(shard)
                self.maybe.pop(key, None)

    @rule(
        namespace=st.sampled_from(NAMESPACES),
        numbers=st.lists(st.integers(0, BLOCKS - 1), min_size=1, max_size=BLOCKS, unique=True),
    )
    def load(self, namespace: str, numbers: list[int]) -> None:
        for number in numbers:
            self._load(namespace, number)

    @rule(
        namespace=st.sampled_from(NAMESPACES),
        numbers=st.lists(st.integers(0, BLOCKS - 1), min_size=1, max_size=BLOCKS, unique=True),
    )
    def dump_then_load(self, namespace: str, numbers: list[int]) -> None:
        """An engine's usual pair: a prefill saves blocks, a later request loads them."""
        self.dump(namespace, numbers)
        self.load(namespace, numbers)

    @precondition(lambda self: any(key[1] == self.epoch for key in self.live))
    @rule(data=st.data())
    def reload(self, data: st.DataObject) -> None:
        """Loads a block the model holds (most loads of a random block miss)."""
        held = sorted(key for key in self.live if key[1] == self.epoch)
        namespace, _, number = data.draw(st.sampled_from(held))
        self._load(namespace, number)

    def _load(self, namespace: str, number: int) -> bool:
        assert self.store is not None
        data = bytearray(SHARD_BYTES)
        address = ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))
        task = self.store.load_data([self._id(number)], [0], [[address]], namespace=namespace)
        try:
            self.store.wait(task)
        except TaskError as exc:
            STATS.missed += 1
            if os.environ.get("UCM_INVARIANTS_DEBUG"):
                print(f"miss: {exc}", file=sys.stderr)
            return False
        STATS.served += 1
        key = (namespace, self.epoch, number)
        expected = self.live.get(key, self.maybe.get(key))
        if expected is None:
            self._violation(
                f"served block {number} of {namespace!r} in epoch {self.epoch}: it was never "
                f"dumped there, or removed, purged or reset since ({self._name(bytes(data))})"
            )
        if bytes(data) != expected:
            self._violation(
                f"served block {number} of {namespace!r} in epoch {self.epoch} with the bytes "
                f"of {self._name(bytes(data))}"
            )
        return True

    def _name(self, data: bytes) -> str:
        """Which dump ``data`` is, if any the run could have made."""
        for namespace in NAMESPACES:
            for epoch in range(self.epoch + 1):
                for number in range(BLOCKS):
                    for generation in range(self.generation.get((namespace, number), 0) + 1):
                        if payload(namespace, epoch, number, generation) == data:
                            return (
                                f"the dump of block {number} of {namespace!r} in epoch {epoch}, "
                                f"removal generation {generation}"
                            )
        return "bytes no dump wrote"

    def _present(self) -> dict[tuple[str, int, int], bool]:
        """Whether the store finds each block the model holds now."""
        assert self.store is not None
        present: dict[tuple[str, int, int], bool] = {}
        for namespace in NAMESPACES:
            keys = sorted(key for key in self.live if key[0] == namespace and key[1] == self.epoch)
            found = self.store.lookup([self._id(key[2]) for key in keys], namespace=namespace)
            present.update(zip(keys, found, strict=True))
        return present

    def _others_kept(self, before: dict[tuple[str, int, int], bool], what: str) -> None:
        """After a remove or purge: every other block the store found before, it finds now
        (where nothing else takes blocks meanwhile: a lower tier's capacity or quota evicts
        in the background)."""
        if self.evicts_below:
            return
        after = self._present()
        for key, there in before.items():
            if there and key in self.live and not after.get(key, False):
                self._violation(
                    f"{what} took block {key[2]} of {key[0]!r} (epoch {key[1]}), not its target"
                )

    @rule(namespace=st.sampled_from(NAMESPACES), number=st.integers(0, BLOCKS - 1))
    def remove(self, namespace: str, number: int) -> None:
        assert self.store is not None
        before = self._present()
        self.store.remove([self._id(number)], force=True, namespace=namespace)
        self._removed(namespace, [number])
        self._others_kept(before, f"remove of block {number} of {namespace!r}")
        STATS.removes += 1

    def _removed(self, namespace: str, numbers: list[int]) -> None:
        for number in numbers:
            key = (namespace, number)
            self.generation[key] = self.generation.get(key, 0) + 1
            for epoch in range(self.epoch + 1):
                self.live.pop((namespace, epoch, number), None)
                self.maybe.pop((namespace, epoch, number), None)

    @rule(namespace=st.sampled_from(NAMESPACES))
    def purge(self, namespace: str) -> None:
        assert self.store is not None
        before = self._present()
        self.store.purge(namespace)
        self._purged(namespace)
        self._others_kept(before, f"a purge of {namespace!r}")

    def _purged(self, namespace: str) -> None:
        self._removed(namespace, list(range(BLOCKS)))
        self.live = {key: data for key, data in self.live.items() if key[0] != namespace}
        self.maybe = {key: data for key, data in self.maybe.items() if key[0] != namespace}
        STATS.purges += 1

    @precondition(lambda self: self.cli_purges < CLI_PURGES_MAX)
    @rule(namespace=st.sampled_from(NAMESPACES))
    def purge_from_the_cli(self, namespace: str) -> None:
        """``ucm purge STACK NAMESPACE`` from a process of its own while this one is open."""
        assert self.store is not None
        self.store.drain()  # what this process acknowledged is in its tiers first
        before = self._present()
        path = self.root / "stack.yaml"
        # The CLI's process has no stalling filesystem: the same files through file://.
        path.write_text(yaml.safe_dump(self.stack).replace("ucmstall://", "file://"))
        command = [sys.executable, "-m", "ucm.cli", "purge", str(path), namespace]
        done = subprocess.run(command, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
        if done.returncode != 0:
            raise AssertionError(f"ucm purge exited {done.returncode}: {done.stderr[-2000:]}")
        self.cli_purges += 1
        STATS.cli_purges += 1
        self._purged(namespace)
        self._others_kept(before, f"`ucm purge` of {namespace!r}")

    @precondition(lambda self: self.kills < KILLS_MAX)
    @rule(
        namespace=st.sampled_from(NAMESPACES),
        numbers=st.lists(st.integers(0, BLOCKS - 1), min_size=1, max_size=BLOCKS, unique=True),
        when=st.sampled_from(["after_dump", "at_random"]),
        delay_ms=st.integers(0, 400),
    )
    def kill_a_rank_mid_write(
        self, namespace: str, numbers: list[int], when: str, delay_ms: int
    ) -> None:
        """Another rank process of the node dumps blocks and is killed (SIGKILL) while its
        writes are under way: right after its dump returned (its write-through still going
        down, a stalling tier holding it) or at a random point. Its blocks may be anywhere
        now, whole or not at all: served byte-exact or missed, never torn or wrong, and this
        process goes on without a hang."""
        assert self.store is not None
        generations = [self.generation.get((namespace, n), 0) for n in numbers]
        order = {
            "stack": self.stack,
            "base": self.base.hex(),
            "epoch": self.epoch,
            "namespace": namespace,
            "numbers": numbers,
            "generations": generations,
        }
        rank = subprocess.Popen(
            [sys.executable, "-m", "harness.invariants", "--rank", json.dumps(order)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            if when == "after_dump":
                assert rank.stdout is not None
                rank.stdout.readline()  # "dumped", or "" if it died first
            time.sleep(delay_ms / 1000)
        finally:
            rank.kill()
            rank.wait(CLI_TIMEOUT_S)
        self.kills += 1
        STATS.kills += 1
        for number, generation in zip(numbers, generations, strict=True):
            key = (namespace, self.epoch, number)
            if key not in self.live:
                self.maybe[key] = payload(namespace, self.epoch, number, generation)
        self.corrupted = (
            True  # a killed write may leave a torn object: a miss, promised kept no more
        )

    @precondition(lambda self: bool(self.lower_roots))
    @rule(
        pick=st.integers(0, 10**6),
        kind=st.sampled_from(["random", "truncated", "flipped", "empty", "longer"]),
    )
    def corrupt(self, pick: int, kind: str) -> None:
        """Someone with write access to a lower tier damages one stored object: its block is
        a miss from then on (or served from a tier above, byte-exact), never wrong bytes."""
        stored = sorted(
            path
            for root in self.lower_roots
            for path in root.rglob("*")
            if path.is_file()
            and (path.suffix == ".blk" or path.name.isdigit())
            # Blocks only: a damaged control record fails the epoch read closed
            # (tests/integration/test_epoch_records.py), which this model does not follow.
            and "control" not in path.relative_to(self.root).parts
        )
        if not stored:
            return
        path = stored[pick % len(stored)]
        try:
            original = path.read_bytes() or b"\0"  # an object an earlier rule emptied
        except FileNotFoundError:  # evicted meanwhile, in the background
            return
        if kind == "random":
            hostile = hashlib.blake2b(original, digest_size=64).digest() * (pick % 97 + 1)
        elif kind == "truncated":
            hostile = original[: pick % max(len(original), 1)]
        elif kind == "flipped":
            at = pick % max(len(original), 1)
            hostile = original[:at] + bytes([original[at] ^ 0x5A]) + original[at + 1 :]
        elif kind == "longer":
            hostile = original + original
        else:
            hostile = b""
        self.corrupted = True  # before the write: a half-done write damages as much
        STATS.damaged += 1
        try:
            path.write_bytes(hostile)
        except FileNotFoundError:
            return  # the block may be lost now: nothing promised keeps it

    @rule()
    def reset(self) -> None:
        assert self.store is not None and self.epochs is not None
        epoch = Epochs(self.base).begin(self.store, after=self.epoch)
        self.epoch += 1
        if epoch != self.epoch:
            self._violation(f"a reset began epoch {epoch}, the model's is {self.epoch}")
        STATS.resets += 1

    @rule()
    def reopen(self) -> None:
        """Every rank closes (the CacheBuffer is gone with the last), then one opens again."""
        assert self.store is not None and self.epochs is not None
        self.epochs.close()
        self.store.close()
        self.store = None
        if not self.stack["tiers"] or (self.buffered and len(self.stack["tiers"]) == 1):
            # Nothing outlives the buffer: the blocks and the epoch are gone together.
            self.live.clear()
            self.maybe.clear()
            self.epoch = 0
            self.base = hashlib.blake2b(uuid.uuid4().bytes, digest_size=16).digest()
        self._open()
        STATS.reopens += 1
        if self.keeps_all and not self.corrupted:
            for (namespace, epoch, number), _ in list(self.live.items()):
                if epoch == self.epoch and not self._load(namespace, number):
                    self._violation(
                        f"block {number} of {namespace!r} (epoch {epoch}) was lost across a "
                        "close and reopen, though a lower tier takes every write"
                    )

    @invariant()
    def counted(self) -> None:
        STATS.steps += 1

    def teardown(self) -> None:
        try:
            if self.epochs is not None:
                self.epochs.close()
            if self.store is not None:
                self.store.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def run(minutes: float, seed: int, *, examples: int, steps: int, shrink: bool) -> int:
    """Seeded runs of ``examples`` examples of up to ``steps`` steps each, one seed after
    another until ``minutes`` are up (at least one seed); returns the exit status: 1 on a
    broken promise (hypothesis prints the steps that broke it), else 0."""
    from hypothesis import HealthCheck, Phase
    from hypothesis import seed as with_seed
    from hypothesis.stateful import run_state_machine_as_test

    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    test_settings = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
    )
    runner: Any = run_state_machine_as_test  # typed in some hypothesis releases, not in others
    deadline = time.monotonic() + minutes * 60
    seeds = 0
    status = 0
    while seeds == 0 or time.monotonic() < deadline:
        seeded = with_seed(seed + seeds)(type("SeededPromises", (Promises,), {}))
        try:
            runner(seeded, settings=test_settings)
        except Exception as exc:  # a broken promise, or hypothesis's report of a flaky one
            broken = [str(exc)] + [str(sub) for sub in getattr(exc, "exceptions", ())]
            print(f"seed {seed + seeds}: {' | '.join(broken)}", file=sys.stderr)
            if not isinstance(exc, AssertionError):
                traceback.print_exception(exc, file=sys.stderr)
            status = 1
            break
        finally:
            seeds += 1
    print(
        f"seeds {seeds} (from {seed}), runs {STATS.runs}, steps {STATS.steps}, loads served "
        f"{STATS.served}, missed {STATS.missed}, resets {STATS.resets}, purges {STATS.purges}, "
        f"removes {STATS.removes}, reopens {STATS.reopens}, cli purges {STATS.cli_purges}, "
        f"ranks killed {STATS.kills}, objects damaged {STATS.damaged}, "
        f"violations {len(STATS.violations)}"
    )
    return status


def rank(order_json: str) -> None:
    """A rank process of :meth:`Promises.kill_a_rank_mid_write`: dumps its blocks, says so,
    and lingers until it is killed (its writes below still under way)."""
    order = json.loads(order_json)
    base = bytes.fromhex(order["base"])
    store = ucm.open(order["stack"], device_id=0, local_rank_size=1)
    data = [
        bytearray(payload(order["namespace"], order["epoch"], number, generation))
        for number, generation in zip(order["numbers"], order["generations"], strict=True)
    ]
    ids = [
        hashlib.blake2b(f"{order['epoch']}:{n}".encode(), key=base, digest_size=16).digest()
        for n in order["numbers"]
    ]
    addresses = [[ctypes.addressof((ctypes.c_char * SHARD_BYTES).from_buffer(d))] for d in data]
    task = store.dump_data(ids, [0] * len(ids), addresses, namespace=order["namespace"])
    with contextlib.suppress(TaskError):  # what failed is a miss; the parent allows either
        store.wait(task)
    print("dumped", flush=True)
    time.sleep(CLI_TIMEOUT_S)  # killed long before


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m harness.invariants", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="run seeds until then")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--examples", type=int, default=10, help="examples (stacks) per seed")
    parser.add_argument("--steps", type=int, default=30, help="most operations per example")
    parser.add_argument(
        "--shrink", action="store_true", help="shrink a failing example (slow) before printing it"
    )
    parser.add_argument("--rank", help=argparse.SUPPRESS)  # a rank process the model kills
    args = parser.parse_args()
    if args.rank is not None:
        rank(args.rank)
        return
    sys.exit(
        run(args.minutes, args.seed, examples=args.examples, steps=args.steps, shrink=args.shrink)
    )


if __name__ == "__main__":
    main()
