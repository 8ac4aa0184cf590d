"""The Store: UCM's public API over a stack of tiers (DESIGN.md "Public Python API").

Cascade semantics: a load is served by the first tier holding the key and promoted into the top
tier (and into intermediate tiers with ``promote: true``); a dump goes to the top tier within the
task, then asynchronously to every ``write: through`` tier; ``write: back`` tiers receive shards
that a tier above evicts. Touch and remove reach every tier; lookup stops descending at the first
tier that answers.

Every call into a lower tier on the look-up path is bounded (``ucm.breaker``): each lower tier
has a deadline (``lookup_timeout_ms``) past which its answer is "miss", and a circuit breaker
that skips it (look-ups and loads answer "miss") after consecutive failures until a probe
succeeds. :meth:`Store.lookup_on_prefix` stops at the first missing block and asks each tier
in one batch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

from . import arguments, namespaces
from .admission import Admission, GatedTier
from .breaker import TierGuard
from .buffer import BufferTier, BufferTierConfig
from .config import LowerTierConfig
from .errors import (
    ConfigError,
    InvalidArgumentError,
    KeyMissingError,
    LookupUnansweredError,
    RoleError,
    StoreClosedError,
    TierError,
    UcmError,
)
from .finality import Finality, forced_remove
from .layout import Key, Layout
from .loadqueue import DumpItem, DumpQueue, LoadPath
from .native.buffer import CONTROL_NAME_BYTES, SLOT_NONE, NamespaceTableFullError
from .native.queue import LOCAL_RANK_SIZE_MAX, NativeQueue, TaskKind
from .native.removals import process_log
from .plugins import tier_types
from .stack import StackConfig, load_stack
from .task import Progress, Task
from .tier import (
    HOST_MEMORY_OPTION,
    NAMESPACE_BYTES_OPTION,
    NamespaceBytes,
    Outcome,
    ShardViews,
    Tier,
    TierContext,
)

DEFAULT_WRITE_QUEUE_BYTES = 256 * 1024 * 1024


class Pin:
    """The shards of one block that :meth:`Store.pin` holds in the CacheBuffer, until
    :meth:`Store.unpin`. ``held`` of them (0 .. ``shards_per_block``) were Ready in the buffer
    and cannot be evicted meanwhile; the others (below the buffer, or absent) are not held."""

    __slots__ = ("_slots", "block_id")

    def __init__(self, block_id: bytes, slots: tuple[int, ...]) -> None:
        self.block_id = block_id
        self._slots = slots

    @property
    def held(self) -> int:
        """How many of the block's shards this pin holds in the buffer."""
        return len(self._slots)

    def __repr__(self) -> str:
        return f"Pin({self.block_id.hex()}, held={self.held})"


class Store:
    """One rank's handle on a tier stack. Thread-safe; use as a context manager.

    Loads and prefetches run in one engine, the native queue (:class:`~ucm.loadqueue.LoadPath`:
    native dispatcher and copy threads, Python loader threads for the tiers below): the
    buffer's queue, or a queue over a null buffer for a stack without one. The buffer part of
    dumps runs there too. Dumps that feed ``write: through`` tiers (or a stack without a
    buffer) also pass through the :class:`~ucm.loadqueue.DumpQueue`. Many tasks may be in
    flight at once.
    """

    def __init__(
        self,
        config: StackConfig,
        device_id: int = 0,
        local_rank_size: int = 1,
        namespace: str = namespaces.DEFAULT_NAMESPACE,
    ) -> None:
        if not isinstance(config, StackConfig):
            raise InvalidArgumentError(
                f"config must be a ucm.StackConfig (ucm.load_stack makes one from a path or a "
                f"mapping; ucm.open takes those too), got {type(config).__name__} "
                f"{arguments.short(config)}"
            )
        _check_rank(device_id, local_rank_size)
        self.namespace = namespaces.check_namespace(namespace)
        """The namespace of every call that does not name one (``namespace=``)."""
        self.config = config
        self.device_id = device_id
        self.local_rank_size = local_rank_size
        self.layout = Layout(
            shard_size=config.resolved_shard_size,
            shards_per_block=config.shards_per_block,
            tensor_sizes=config.resolved_tensor_sizes,
        )
        self._counters: Counter[str] = Counter()
        self._counters_lock = threading.Lock()
        self._teardown_lock = threading.RLock()
        """Held while native memory is read (:meth:`stats`, :meth:`reading`), and by
        :meth:`close` while it destroys the queue and unmaps the tiers: a metrics scrape that
        runs while the engine shuts down never reads memory being freed."""
        self._torn_down = False
        self._closed = False
        self._final_tier_stats: list[dict[str, Any]] | None = None
        self.tiers: list[Tier] = []
        installed = tier_types()
        host_memory: tuple[tuple[int, int], ...] = ()
        try:
            for position, tier_config in enumerate(config.tiers):
                options: dict[str, Any] = {HOST_MEMORY_OPTION: host_memory} if host_memory else {}
                namespace_bytes = _namespace_bytes(config, tier_config.label)
                if namespace_bytes is not None:
                    options[NAMESPACE_BYTES_OPTION] = namespace_bytes
                context = TierContext(
                    layout=self.layout,
                    unique_id=config.unique_id,
                    device_id=device_id,
                    local_rank_size=local_rank_size,
                    position=position,
                    evict_sink=self._evict_sink_for(position),
                    write_back_remove=self._write_back_remove_for(position),
                    options=options,
                )
                try:
                    self.tiers.append(installed[tier_config.type](tier_config, context))
                except InvalidArgumentError as exc:
                    raise ConfigError(f"tiers[{position}] ({tier_config.type}): {exc}") from exc
                # Memory the buffer keeps mapped (its slots), for the tiers below.
                if isinstance(self.tiers[-1], BufferTier):
                    host_memory += self.tiers[-1].host_memory
        except BaseException:
            for tier in self.tiers:
                tier.close()
            raise
        # A deadline and a breaker for every tier that can sit below the top (the buffer is
        # local shared memory: nothing to time out).
        self._guards: list[TierGuard | None] = [
            TierGuard(tier.label, tier.config.lookup_timeout_ms, tier.config.breaker)
            if isinstance(tier.config, LowerTierConfig)
            else None
            for tier in self.tiers
        ]
        top = self.tiers[0]
        # The shared CacheBuffer (native core), typed: it brings the native load queue.
        self._buffer: BufferTier | None = top if isinstance(top, BufferTier) else None
        # A purge or a forced remove is final (ucm.finality): the buffer's node-wide removal
        # log, or without a buffer this process's own.
        self._finality = (
            self._buffer.finality if self._buffer is not None else Finality(process_log())
        )
        # Namespaces in the buffer's node-wide table (quotas, per-namespace figures): the
        # quotas' named ones and this store's own now, any other when a call first names it.
        self._quota_registered: set[str] = set()
        named = config.quotas.namespaces if config.quotas is not None else {}
        for name in (*named, self.namespace):
            self._register_quota(name)
        # One settings model with or without a buffer (the buffer tier's config is one).
        self.settings = settings = config.load_settings
        self._start = 1 if self._buffer is not None else 0
        # Tiers with an admit: condition (ucm.admission): written at admission, not by dumps
        # nor flushes. The stack's validation guarantees a buffer above them.
        gated: list[GatedTier] = []
        for position, tier in enumerate(self.tiers):
            tier_config = tier.config
            if isinstance(tier_config, LowerTierConfig) and not tier_config.admit.always:
                gated.append(
                    GatedTier(
                        position=position,
                        index=len(gated),
                        tier=tier,
                        rule=tier_config.admit,
                        through=tier_config.write == "through",
                    )
                )
        self._gated_positions = {gate.position for gate in gated}
        through = [
            tier
            for position, tier in enumerate(self.tiers[1:], start=1)
            if isinstance(tier.config, LowerTierConfig)
            and tier.config.write == "through"
            and position not in self._gated_positions
        ]
        self._native: LoadPath | None = None
        self._admission: Admission | None = None
        self._own_queue: NativeQueue | None = None
        self._dumps: DumpQueue | None = None
        self._worker = device_id >= 0
        try:
            if self._worker:
                if self._buffer is not None:
                    queue = self._buffer.queue
                else:  # a null buffer: every key is loaded from the tiers (BYPASS)
                    queue = self._own_queue = NativeQueue(
                        None,
                        [],
                        settings,
                        device_id=device_id,
                        local_rank_size=min(local_rank_size, LOCAL_RANK_SIZE_MAX),
                        shards_per_block=self.layout.shards_per_block,
                        tensor_sizes=self.layout.tensor_sizes,
                    )
                self._native = LoadPath(
                    queue=queue,
                    buffer=self._buffer,
                    fill=self._fill_from_below,
                    count=self._count,
                    shard_size=self.layout.shard_size,
                    settings=settings,
                    dirty_dumps=self._buffer is not None and self._buffer.writes_back,
                )
            if self._worker and gated:
                assert self._buffer is not None  # checked by the stack's validation
                self._admission = Admission(self._buffer, gated, self._count, self._finality)
            # Dumps that Python follows up go through the dump thread: without a buffer, with
            # write-through tiers, or within the write-back bound.
            writes_back = self._buffer is not None and self._buffer.writes_back
            if self._worker and (self._buffer is None or through or writes_back):
                self._dumps = DumpQueue(
                    top=top,
                    through=through,
                    count=self._count,
                    settings=settings,
                    native=self._native,
                    buffer=self._buffer,
                    finality=self._finality,
                )
        except BaseException:
            if self._admission is not None:
                self._admission.close()
            if self._native is not None:
                self._native.close()
            if self._own_queue is not None:
                self._own_queue.destroy()
            for tier in self.tiers:
                tier.close()
            raise
        self._native_final: dict[str, int] | None = None
        self._prefetches: list[Task] = []
        self._prefetch_lock = threading.Lock()
        self._pins: set[Pin] = set()
        self._pins_lock = threading.Lock()

    @property
    def buffer(self) -> BufferTier | None:
        """The stack's CacheBuffer (its top tier), or None for a stack without one."""
        return self._buffer

    # ---- public API -------------------------------------------------------------------------

    def lookup(
        self, block_ids: Sequence[bytes], *, namespace: str | None = None, exact: bool = False
    ) -> list[bool]:
        """Whether every shard of each block is present in some tier (in the namespace).

        A lower tier answers within its deadline and breaker: past them its answer is "absent".
        With ``exact``, a tier that did not answer about a shard no tier above it holds raises
        :class:`~ucm.LookupUnansweredError` instead, for a caller to whom "absent" and "cannot
        tell" differ."""
        self._check_open()
        arguments.check_flag(exact, "exact")
        blocks = self._scoped(block_ids, namespace)
        keys = self.layout.keys_of_blocks(blocks)
        present = self._lookup_keys(keys, exact=exact)
        per_block = self.layout.shards_per_block
        return [all(present[i * per_block : (i + 1) * per_block]) for i in range(len(blocks))]

    def lookup_on_prefix(self, block_ids: Sequence[bytes], *, namespace: str | None = None) -> int:
        """Index of the last block of the longest present prefix, -1 if the first is absent.

        Stops at the first missing block: each tier is asked once, in one batch, about the
        keys from the first one not yet found (a tier may stop soon after its first absent
        key), and each lower tier's answer is bounded by its deadline and breaker. With a
        block's shards split over tiers the answer may be shorter than :meth:`lookup`'s,
        never longer."""
        self._check_open()
        blocks = self._scoped(block_ids, namespace)
        keys = self.layout.keys_of_blocks(blocks)
        present = [False] * len(keys)
        first = 0  # first key not known present
        for position in range(len(self.tiers)):
            ask = [i for i in range(first, len(keys)) if not present[i]]
            if not ask:
                break
            answers = self._tier_lookup(position, [keys[i] for i in ask], prefix=True)
            for i, hit in zip(ask, answers, strict=False):
                present[i] = hit
            while first < len(keys) and present[first]:
                first += 1
        return first // self.layout.shards_per_block - 1

    def prefetch(
        self,
        block_ids: Sequence[bytes],
        *,
        namespace: str | None = None,
        background: bool = False,
        submit_timeout_s: float | None = None,
        shard_index: int | None = None,
    ) -> Task | None:
        """Starts moving the blocks' shards up into the top tier (asynchronously). Returns the
        prefetch's task (``check``/``wait`` it; a shard no tier has fails it), or None when
        there was nothing to move (every shard already in the top tier, or one tier only).
        ``background``: an engine does not wait on it (its asynchronous load), so the tiers
        below read its shards on the loader threads themselves rather than on their pools:
        fewer threads taking the engine's GIL in turn while it computes.
        ``submit_timeout_s``: longest the call blocks while the rank's prefetch queue is full
        (default: the stack's ``queue_timeout_s``); past it, ``TimeoutError``.
        ``shard_index``: only that shard of each block (a rank's own, which its loads read:
        its prefetch then never depends on another rank's)."""
        self._check_open()
        arguments.check_flag(background, "background")
        timeout_s = arguments.check_timeout_s(submit_timeout_s, "submit_timeout_s")
        only = arguments.check_one_shard(shard_index, self.layout)
        originals = arguments.check_block_ids(block_ids)
        blocks = self._scoped(originals, namespace)
        if not self._worker:
            raise RoleError(
                f"prefetch is not allowed on a scheduler (device_id={self.device_id}): the "
                "scheduler role has no data plane to fill; prefetch from a worker rank"
            )
        keys = (
            self.layout.keys_of_blocks(blocks)
            if only is None
            else [(block, only) for block in blocks]
        )
        if not keys or len(self.tiers) == 1:
            return None
        present = self.tiers[0].lookup(keys)
        missing = [key for key, hit in zip(keys, present, strict=True) if not hit]
        if not missing:
            return None
        assert self._native is not None
        job = self._native.submit(
            TaskKind.PREFETCH,
            arguments.TaskKeys.of(missing),
            None,
            background=background,
            timeout_s=timeout_s,
        )
        task = self._native.task("prefetch", job)
        with self._prefetch_lock:
            self._prefetches = [t for t in self._prefetches if not t.done()]
            self._prefetches.append(task)
        # Failures by the caller's ids, as a load's (a namespace's tiers store scoped ids).
        scoped = blocks != originals
        return _unscoped(task, dict(zip(blocks, originals, strict=True)) if scoped else None)

    def load(
        self,
        block_ids: Sequence[bytes],
        shard_index: Any,
        dst: Any,
        *,
        namespace: str | None = None,
        background: bool = False,
        submit_timeout_s: float | None = None,
        fill: bool = True,
    ) -> Task:
        """Loads shard ``shard_index[i]`` of block i into the tensors ``dst[i]``: dense
        (``torch.strided``), contiguous CPU or CUDA tensors of the layout's sizes, no two of
        which share memory (refused for CPU tensors; CUDA ones are not checked).
        ``background``: the caller does not wait on it (an engine's asynchronous load), so its
        copies give the CPU back between batches to the engine's spinning threads; a load an
        engine waits on copies at full speed. ``submit_timeout_s``: longest the call blocks
        while the rank's load queue is full (default: the stack's ``queue_timeout_s``); past
        it, ``TimeoutError``. ``fill=False``: only what the CacheBuffer holds Ready is copied; a
        shard it does not hold fails with ``KeyMissingError`` rather than being read from the
        tiers below (it takes no buffer slot, so nothing is evicted for it), and so does a
        shard another load (a prefetch, another rank's load) is filling right then: it is not
        waited for (a load that must cost a memcpy at most)."""
        arguments.check_flag(background, "background")
        timeout_s = arguments.check_timeout_s(submit_timeout_s, "submit_timeout_s")
        arguments.check_flag(fill, "fill")
        task_keys, memory, ids = self._prepare(block_ids, shard_index, "dst", dst, True, namespace)
        return _unscoped(self._submit_load(task_keys, memory, background, timeout_s, fill), ids)

    def dump(
        self,
        block_ids: Sequence[bytes],
        shard_index: Any,
        src: Any,
        *,
        namespace: str | None = None,
    ) -> Task:
        """Stores the tensors ``src[i]`` as shard ``shard_index[i]`` of block i."""
        task_keys, memory, ids = self._prepare(block_ids, shard_index, "src", src, False, namespace)
        return _unscoped(self._submit_dump(task_keys, memory), ids)

    def load_data(
        self,
        block_ids: Sequence[bytes],
        shard_index: Any,
        dst_ptrs: Any,
        *,
        namespace: str | None = None,
        background: bool = False,
        submit_timeout_s: float | None = None,
        fill: bool = True,
    ) -> Task:
        """Like load, with raw addresses: ``dst_ptrs[i][j]`` receives tensor j of block i
        (``dst_ptrs`` may also be one ``array('Q')`` of every address, key-major).

        The addresses are trusted beyond their shape and the null page (below 4096): each must
        point at mapped, writable memory of tensor j's size (``tensor_size_list[j]``), distinct
        from the call's other destinations, until the task is done; any other address crashes
        the process (a segmentation fault in a copy thread), as checking it would cost a
        system call per address. Check addresses once where they are made
        (``ucm.integration.addresses``)."""
        arguments.check_flag(background, "background")
        timeout_s = arguments.check_timeout_s(submit_timeout_s, "submit_timeout_s")
        arguments.check_flag(fill, "fill")
        task_keys, memory, ids = self._prepare(
            block_ids, shard_index, "dst_ptrs", dst_ptrs, True, namespace
        )
        return _unscoped(self._submit_load(task_keys, memory, background, timeout_s, fill), ids)

    def dump_data(
        self,
        block_ids: Sequence[bytes],
        shard_index: Any,
        src_ptrs: Any,
        *,
        namespace: str | None = None,
    ) -> Task:
        """Like dump, with raw addresses: ``src_ptrs[i][j]`` holds tensor j of block i
        (``src_ptrs`` may also be one ``array('Q')`` of every address, key-major).

        The addresses are trusted beyond their shape and the null page (below 4096): each must
        point at mapped memory of tensor j's size (``tensor_size_list[j]``) until the task is
        done; any other address crashes the process (see :meth:`load_data`)."""
        task_keys, memory, ids = self._prepare(
            block_ids, shard_index, "src_ptrs", src_ptrs, False, namespace
        )
        return _unscoped(self._submit_dump(task_keys, memory), ids)

    def wait_prefetches(self) -> None:
        """Blocks until every prefetch started so far has finished (its errors are ignored:
        a failed prefetch only means the later load reads from below)."""
        with self._prefetch_lock:
            tasks = list(self._prefetches)
        for task in tasks:
            # A failed prefetch only means that the later load reads from below.
            with contextlib.suppress(Exception):
                task.completion.failures(self.settings.queue_timeout_s)

    def wait(self, task: Task, timeout_s: float | None = None) -> None:
        """Blocks until the task finishes; raises TaskError naming each failed key.

        ``timeout_s`` bounds the wait (None: until it finishes; a bound above
        ``threading.TIMEOUT_MAX``, about 292 years, is taken as that). Past it, TimeoutError
        names the task, and the task goes on: a load may still write its destination memory and a
        dump may still read its source until ``check(task)`` is True, so keep that memory
        until then (wait again, or check)."""
        _check_task(task)
        task.result(arguments.check_timeout_s(timeout_s))

    def check(self, task: Task) -> bool:
        """Non-blocking: whether the task finished (successfully or not)."""
        _check_task(task)
        return task.done()

    def pin(
        self,
        block_ids: Sequence[bytes],
        *,
        namespace: str | None = None,
        shard_index: int | None = None,
    ) -> list[Pin]:
        """Holds each block's shards that are Ready in the CacheBuffer there, so that no
        eviction (of this rank or any other on the node) takes them, until :meth:`unpin`; one
        :class:`Pin` per block, saying how many shards it holds. Shards below the buffer, or
        absent, are not held (a pin never loads nor allocates), and a stack without a buffer,
        or the scheduler role, holds nothing. ``remove(force=True)`` still removes a pinned
        shard (its memory is freed at the unpin). Pins held at :meth:`close` are released.
        ``shard_index``: only that shard of each block (a rank's own): ``held`` is 0 or 1."""
        self._check_open()
        only = arguments.check_one_shard(shard_index, self.layout)
        originals = arguments.check_block_ids(block_ids)
        blocks = self._scoped(originals, namespace)
        if self._native is None or self._buffer is None or not blocks:
            return [Pin(block, ()) for block in originals]
        per_block = self.layout.shards_per_block if only is None else 1
        if per_block == 1:  # one shard a block: without the per-shard loops (the hit path)
            ids = b"".join(blocks)
            shards = array("I", [only or 0]) * len(blocks)
        else:
            ids = b"".join(block for block in blocks for _ in range(per_block))
            shards = array("I", list(range(per_block)) * len(blocks))
        with self._pins_lock:
            self._check_open()
            slots = self._native.queue.pin(ids, shards)
            if per_block == 1:
                pins = [
                    Pin(block, () if slot == SLOT_NONE else (slot,))
                    for block, slot in zip(originals, slots, strict=True)
                ]
            else:
                pins = [
                    Pin(
                        block,
                        tuple(
                            s for s in slots[i * per_block : (i + 1) * per_block] if s != SLOT_NONE
                        ),
                    )
                    for i, block in enumerate(originals)
                ]
            held = [pin for pin in pins if pin._slots]
            self._pins.update(held)
        self._count("pinned_shards", sum(len(pin._slots) for pin in held))
        return pins

    def unpin(self, pins: Sequence[Pin]) -> None:
        """Releases pins from :meth:`pin` (one already released, or released by close, is
        skipped)."""
        if not isinstance(pins, Sequence) or not all(isinstance(pin, Pin) for pin in pins):
            raise InvalidArgumentError(
                f"pins must be a list of the Pin objects store.pin returned, got {pins!r}"
            )
        with self._pins_lock:
            slots = array("I")
            for pin in pins:
                if pin in self._pins:
                    self._pins.discard(pin)
                    slots.extend(pin._slots)
            if slots and self._native is not None:
                self._native.queue.unpin(slots)
        self._count("unpinned_shards", len(slots))

    def touch(self, block_ids: Sequence[bytes], *, namespace: str | None = None) -> None:
        """Renews every resident shard of the blocks in every tier."""
        self._check_open()
        blocks = self._scoped(block_ids, namespace)
        if blocks:
            for tier in self.tiers:
                tier.touch(blocks)

    def read_control(self, names: Sequence[bytes]) -> list[int]:
        """Control records (a key space's reset epoch: :class:`~ucm.integration.keys.Epochs`):
        each record's value, the maximum over every tier of the stack (0 where none holds it).
        Records are no blocks: outside admission, quotas, eviction, codecs and namespaces.

        Every tier must answer exactly, each within its deadline and breaker: one that does not
        (unreachable, past its ``lookup_timeout_ms``, a record it holds is torn or corrupt, a
        tier type that keeps no control records) raises :class:`~ucm.LookupUnansweredError`
        naming it, so that the caller fails closed (a lower value could serve blocks from
        before a reset). Works on a scheduler-role store."""
        self._check_open()
        checked = _control_names(names)
        values = [0] * len(checked)
        for position, tier in enumerate(self.tiers):
            answers = self._control_call(position, partial(_read_records, tier, checked), "read")
            if len(answers) != len(checked) or not all(
                a is None or (isinstance(a, int) and a >= 0) for a in answers
            ):
                raise LookupUnansweredError(
                    f"tier {tier.label!r} answered a read of {len(checked)} control record(s) "
                    f"with {arguments.short(answers)}: one int >= 0 or None per record expected"
                )
            values = [max(v, a or 0) for v, a in zip(values, answers, strict=True)]
        return values

    def raise_control(self, name: bytes, value: int) -> None:
        """Raises control record ``name`` (16 bytes) to at least ``value`` in every tier of
        the stack (the buffer's node-wide table and every lower tier, whatever their
        ``write:``, ``admit:``, codec and quotas), synchronously, each within its deadline.
        Raises a :class:`~ucm.TierError` naming every tier it could not be written to (after
        trying them all: the record lands wherever it can)."""
        self._check_open()
        (checked,) = _control_names([name])
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
            raise InvalidArgumentError(
                f"value={value!r} is not valid: a control record's value is an int in [0, 2**64)"
            )
        failures = []
        for position, tier in enumerate(self.tiers):
            try:
                self._control_call(position, partial(_raise_record, tier, checked, value), "write")
            except UcmError as exc:
                failures.append(str(exc))
        if failures:
            raise TierError(
                f"control record {checked.hex()} could not be raised to {value} in every tier: "
                + "; ".join(failures)
            )

    def _control_call(self, position: int, call: Callable[[], Any], what: str) -> Any:
        """One tier's control record call, bounded by its deadline and breaker; raises
        :class:`~ucm.LookupUnansweredError` naming the tier when it did not answer."""
        tier = self.tiers[position]
        if type(tier).read_control is Tier.read_control:  # no records: never trips a breaker
            raise LookupUnansweredError(
                f"tier {tier.label!r} (type {tier.type_name!r}) keeps no control records (it "
                f"implements no Tier.read_control/raise_control): a control record {what} "
                "cannot be answered by it"
            )
        guard = self._guards[position]
        if guard is None:  # the buffer: local shared memory
            try:
                return call()
            except UcmError as exc:
                raise LookupUnansweredError(
                    f"tier {tier.label!r}: control record {what}: {exc}"
                ) from exc
        answer = guard.call(call, None, exact=True)
        if answer is None:
            raise LookupUnansweredError(
                f"tier {tier.label!r} did not answer a control record {what}: {guard.last_miss}"
            )
        return answer

    def remove(
        self, block_ids: Sequence[bytes], force: bool = False, *, namespace: str | None = None
    ) -> int:
        """Removes every shard of the blocks from every tier; returns distinct shards removed.
        Shards in use are kept unless ``force``."""
        self._check_open()
        arguments.check_flag(force, "force")
        blocks = self._scoped(block_ids, namespace)
        keys = list(dict.fromkeys(self.layout.keys_of_blocks(blocks)))
        if not keys:
            return 0
        # Pending write-through work would resurrect removed shards below: finish it first.
        self.drain()
        before = self._lookup_keys(keys, stop_early=False, bounded=False)
        if force:
            self._remove_finally(
                lambda: self._finality.record_removes(blocks),
                lambda tier: tier.batched_remove(keys, force=True),
            )
        else:
            for tier in self.tiers:
                tier.batched_remove(keys)
        after = self._lookup_keys(keys, stop_early=False, bounded=False)
        removed = sum(1 for was, still in zip(before, after, strict=True) if was and not still)
        self._count("removed_shards", removed)
        return removed

    def namespaces(self) -> dict[str, list[int | None]]:
        """Shards held per namespace and tier (top first): ``{namespace: [shards in tier 0,
        ...]}``, ``None`` where a tier cannot enumerate its keys (Mooncake). Keys are named
        by the CacheBuffer's identity table (every namespace used with the buffer is in it,
        so a key whose tag it lacks is the default namespace's) and, below it, by the tiers'
        own ``ns/<name>/`` layout (ucm/namespaces.py)."""
        self._check_open()
        self.drain()
        per_tier: list[dict[str, int] | None] = []
        # Lower tiers first: their ns/<name>/ prefixes name namespaces no buffer holds.
        for tier in reversed(self.tiers):
            per_tier.append(tier.namespace_usage())
        per_tier.reverse()
        names = sorted({name for usage in per_tier if usage for name in usage})
        return {
            name: [None if usage is None else usage.get(name, 0) for usage in per_tier]
            for name in names
        }

    def purge(self, namespace: str) -> list[int]:
        """Removes every block of ``namespace`` from every tier (pinned and in-use shards
        too), batched; returns the shards removed per tier, top first."""
        self._check_open()
        name = namespaces.check_namespace(namespace)
        # Pending write-through work would bring purged shards back below: finish it first.
        self.drain()
        removed = self._remove_finally(
            lambda: self._finality.record_purge(name), lambda tier: tier.purge(name)
        )
        self._count("purged_shards", sum(removed))
        return removed

    def _remove_finally(
        self, record: Callable[[], None], remove: Callable[[Tier], int]
    ) -> list[int]:
        """A removal that is final (ucm.finality): the buffer first, then the removal goes in
        the removal log, then the tiers below. A write to a lower tier that lands after this
        cleared it carries bytes taken before the buffer was cleared, so it started before the
        record and finds it once landed; one that landed earlier is cleared here."""
        removed: list[int] = []
        for position, tier in enumerate(self.tiers):
            if position == self._start:
                record()
            removed.append(remove(tier))
        return removed

    def drain(self) -> None:
        """Blocks until every dump submitted so far is written to every ``write: through``
        tier (what close() also does), and, with ``admit:`` conditions, until the admission
        checks of this process's finished loads and due residency checks ran. After
        :meth:`close` (which drains), :class:`~ucm.StoreClosedError`."""
        self._check_open()
        if self._dumps is not None:
            self._dumps.drain()
        if self._admission is not None:
            self._admission.settle()

    def stats(self) -> dict[str, Any]:
        """Store counters plus each tier's own counters under ``tiers`` and, under
        ``namespaces``, each namespace's node-wide CacheBuffer figures (slots and bytes held,
        guarantee and cap, Get hits, misses, evictions; see ``BufferTier.namespace_stats``),
        and under ``namespace_tiers`` each lower tier's bytes and evictions per namespace
        (:meth:`namespace_tier_stats`). Safe beside :meth:`close` (another thread's scrape):
        once closed it reports what the store had at close."""
        with self._teardown_lock:
            return self._stats()

    @contextlib.contextmanager
    def reading(self) -> Iterator[bool]:
        """Holds off :meth:`close`'s unmapping while the caller reads this store's native
        memory (``store.buffer.core``: a metrics snapshot from another thread); yields whether
        that memory is still there (False once the store is closed: read nothing then)."""
        with self._teardown_lock:
            yield not self._torn_down

    def _stats(self) -> dict[str, Any]:
        with self._counters_lock:
            counters: dict[str, Any] = dict(self._counters)
        # The load engine's counters: the queue owns these names (the store never counts them).
        if self._native is not None and not self._native.queue.destroyed:
            native = self._native.queue.stats()
            counters.update({name: native[name] for name in _NATIVE_STORE_COUNTERS})
        elif self._native_final is not None:
            counters.update(self._native_final)
        for name in (
            "hits",
            "misses",
            "loaded_shards",
            "dumped_shards",
            "failed_shards",
            "repaired_shards",
            "write_through_skipped",
            "admitted_shards",
            "admitted_bytes",
            "declined_shards",
            "declined_bytes",
            "background_paced_shards",
            "background_paced_us",
        ):
            counters.setdefault(name, 0)
        counters.update(self._finality.counts())  # writes_retracted, retract_failures
        lookups = counters["hits"] + counters["misses"]
        counters["hit_rate"] = counters["hits"] / lookups if lookups else 0.0
        writer = self._dumps.writer if self._dumps is not None else None
        counters["write_queue_bytes"] = writer.pending_bytes if writer is not None else 0
        counters["write_snapshot_bytes"] = writer.kept_bytes if writer is not None else 0
        # A closed tier may have unmapped its counters: report what it had at close.
        counters["tiers"] = self._final_tier_stats or self._tier_stats()
        # Node-wide, per namespace (the buffer's namespace table): {} without a buffer.
        counters["namespaces"] = (
            self._buffer.namespace_stats() if self._buffer is not None and not self._closed else {}
        )
        counters["namespace_tiers"] = self.namespace_tier_stats()
        return counters

    def namespace_tier_stats(
        self, wait_s: float = 0.0
    ) -> dict[str, dict[str, dict[str, int]] | None]:
        """Per lower tier (by label, top first), each namespace's bytes there and this
        process's evictions of its shards there: ``{label: {namespace: {"bytes": ...,
        "evictions": ...}}}``, ``None`` for a tier that cannot tell (Mooncake Store lists no
        keys) or has not finished its first scan (see ``Tier.namespace_figures``: posix and
        fsspec scan in the background, at most once a minute, when stats are read). Waits at
        most ``wait_s`` (seconds, 0 or more) for a scan under way."""
        deadline = time.monotonic() + arguments.check_seconds(wait_s, "wait_s")
        return {
            tier.label: tier.namespace_figures(max(0.0, deadline - time.monotonic()))
            for tier in self.tiers
            if tier is not self._buffer
        }

    def close(self) -> None:
        """Finishes pending tasks and write-through work (the backlog for ``queue_timeout_s``
        at most: what is still queued then skips the write-through tiers), then closes every
        tier."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        try:
            with self._pins_lock:  # before the queue goes: their references are its uses
                held = list(self._pins)
            self.unpin(held)
            if self._dumps is not None and not self._dumps.close():
                # A dump a tier still holds (it may still hand work to the native queue, and
                # copy into the buffer's mappings): keep both, as for loads that outlive the
                # close.
                sys.stderr.write(
                    f"ucm: a dump still running after {self.settings.queue_timeout_s} s at "
                    "close (a tier holds its write); leaving it running\n"
                )
                if self._native is not None:
                    self._native.queue.abandon()
            if self._native is not None:
                self._native.close()
            if self._admission is not None:  # after the loads finished, before the flushes
                try:
                    self._admission.close()
                except Exception as exc:  # the flushes and closes below still run
                    errors.append(exc)
            # Top first: the buffer's write-back debt lands in the tiers below before they
            # flush. One tier's failure does not keep the others from flushing.
            for tier in self.tiers:
                try:
                    tier.flush()
                except Exception as exc:
                    errors.append(exc)
        finally:
            with self._teardown_lock:  # not while stats() reads what is freed here
                self._torn_down = True
                self._final_tier_stats = self._tier_stats()
                if self._native is not None and not self._native.queue.destroyed:
                    native = self._native.queue.stats()
                    self._native_final = {name: native[name] for name in _NATIVE_STORE_COUNTERS}
                if self._own_queue is not None:  # left alone when abandoned (tasks outlived it)
                    self._own_queue.destroy()
                for tier in self.tiers:
                    tier.close()
                for guard in self._guards:
                    if guard is not None:
                        guard.close()
        if errors:
            raise errors[0]

    def _tier_stats(self) -> list[dict[str, Any]]:
        return [
            {
                "type": tier.type_name,
                "name": tier.label,
                **tier.stats(),
                **(guard.stats() if guard is not None else {}),
                **(
                    self._admission.stats_of(position)
                    if self._admission is not None and position in self._gated_positions
                    else {}
                ),
            }
            for position, (tier, guard) in enumerate(zip(self.tiers, self._guards, strict=True))
        ]

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed; open a new one with ucm.open()")

    def _count(self, name: str, amount: int = 1) -> None:
        with self._counters_lock:
            self._counters[name] += amount

    def _scoped(self, block_ids: Any, namespace: str | None) -> list[bytes]:
        """The checked block ids as the tiers store them in ``namespace`` (the store's own
        when None): see ucm/namespaces.py."""
        blocks = arguments.check_block_ids(block_ids)
        if namespace is None:
            namespace = self.namespace
        elif namespace != self.namespace:
            namespaces.check_namespace(namespace)
            if namespace not in self._quota_registered:
                self._register_quota(namespace)
        return namespaces.scope(namespace, blocks)

    def use_namespace(self, namespace: str) -> None:
        """Makes ``namespace`` known to this store as a call naming it does at its first use:
        its name resolves in stats and listings, its lower-tier keys go under its prefix, and
        the buffer's node-wide namespace table holds it with its quota (its own, else
        ``quotas.others``), so that its slots, hits, misses and evictions are its own. For an
        engine whose ids arrive scoped already (vLLM's scheduler scopes each request's ids;
        its workers announce each new namespace with this)."""
        self._check_open()
        name = namespaces.check_namespace(namespace)
        if name not in self._quota_registered:
            self._register_quota(name)

    def _register_quota(self, namespace: str) -> None:
        """Registers ``namespace`` in the buffer's tables once per store, before any key of it
        can land there: its identity (tag and name: how every process of the node tells its
        keys from the default namespace's; a full identity table fails the call, see
        :class:`~ucm.native.buffer.NamespaceNamesFullError`), then its CacheBuffer quota (its
        own, else ``quotas.others``; none without ``quotas:``), so that its slots, hits,
        misses and evictions are its own. A full quota table leaves it counted in the default
        namespace's quota entry."""
        namespaces.register(namespace)  # this process resolves its keys without asking
        if self._buffer is None:
            self._quota_registered.add(namespace)
            return
        self._buffer.register_name(namespace)
        self._quota_registered.add(namespace)
        quotas = self.config.quotas
        quota = quotas.for_namespace(namespace).buffer if quotas is not None else None
        try:
            self._buffer.register_quota(namespace, quota)
        except NamespaceTableFullError:
            if quotas is not None and namespace in quotas.namespaces:
                raise  # a named quota that cannot be kept is an error, not a fallback

    def _prepare(
        self,
        block_ids: Any,
        shard_index: Any,
        name: str,
        buffers: Any,
        for_load: bool,
        namespace: str | None,
    ) -> tuple[arguments.TaskKeys, arguments.ShardMemory, dict[bytes, bytes] | None]:
        """The task's checked keys (the ids the tiers store) and memory, and for a namespace
        other than the default, each stored id's caller id (for the task's keys and errors)."""
        self._check_open()
        if self.device_id < 0:
            verb = "load" if for_load else "dump"
            raise RoleError(
                f"{verb} is not allowed on a scheduler (device_id={self.device_id}): the "
                "scheduler role only answers lookups; open the store with device_id >= 0"
            )
        ids: dict[bytes, bytes] | None = None
        space = self.namespace if namespace is None else namespaces.check_namespace(namespace)
        if space not in self._quota_registered:
            self._register_quota(space)
        if space != namespaces.DEFAULT_NAMESPACE:
            originals = arguments.check_block_ids(block_ids)
            block_ids = namespaces.scope(space, originals)
            ids = dict(zip(block_ids, originals, strict=True))
        task_keys = arguments.check_task_keys(block_ids, shard_index, self.layout)
        if name.endswith("_ptrs"):
            memory = arguments.check_pointers(buffers, len(task_keys), self.layout, name)
        else:
            memory = arguments.check_tensors(buffers, len(task_keys), self.layout, name, for_load)
        return task_keys, memory, ids

    def _submit_load(
        self,
        task_keys: arguments.TaskKeys,
        memory: arguments.ShardMemory,
        background: bool = False,
        timeout_s: float | None = None,
        fill: bool = True,
    ) -> Task:
        if not len(task_keys):  # nothing to load: done at once, and not a task of the queue
            return Task("load", [], Progress([]))
        assert self._native is not None  # the queue counts its load tasks
        job = self._native.submit(
            TaskKind.LOAD,
            task_keys,
            memory,
            background=background,
            timeout_s=timeout_s,
            fill=fill,
        )
        task = self._native.task("load", job)
        if self._admission is not None:
            self._admission.on_load(task.done, task_keys.keys)
        return task

    def _submit_dump(self, task_keys: arguments.TaskKeys, memory: arguments.ShardMemory) -> Task:
        self._count("dump_tasks")
        if not len(task_keys):
            return Task("dump", [], Progress([]))
        if self._admission is not None:
            self._admission.on_dump(task_keys.keys)
        if self._dumps is None:  # straight into the buffer's native queue
            assert self._native is not None
            job = self._native.submit(TaskKind.DUMP, task_keys, memory)
            task = self._native.task("dump", job)
        else:
            progress = Progress(
                task_keys.keys, on_complete=lambda _done: arguments.release_staging(memory)
            )
            try:
                self._dumps.submit(DumpItem(task_keys, memory, progress))
            except BaseException:
                arguments.release_staging(memory)
                raise
            task = Task("dump", task_keys, progress)
        if self._admission is not None:
            # A dump of a shard already in the buffer is a use: checked like a load's keys.
            self._admission.on_load(task.done, task_keys.keys)
        return task

    def _tier_lookup(
        self, position: int, keys: list[Key], prefix: bool = False, exact: bool = False
    ) -> list[bool]:
        """One tier's answers about ``keys`` (with ``prefix``, possibly only the first ones, up
        to and including its first absent key); a lower tier's are bounded by its deadline and
        breaker ("miss" past them; with ``exact``, :class:`LookupUnansweredError`)."""
        tier = self.tiers[position]
        ask = tier.lookup_prefix if prefix else tier.lookup
        guard = self._guards[position]
        if guard is None:
            return list(ask(keys))
        answer = guard.call(lambda: list(ask(keys)), None, exact=exact)
        if answer is not None:
            return answer
        if exact:
            raise LookupUnansweredError(
                f"tier {tier.label!r} did not answer a look-up of {len(keys)} shard(s): "
                f"{guard.last_miss}; whether they are there is unknown"
            )
        return [False] * len(keys)

    def _lookup_keys(
        self, keys: list[Key], stop_early: bool = True, bounded: bool = True, exact: bool = False
    ) -> list[bool]:
        present = [False] * len(keys)
        pending = list(range(len(keys)))
        for position, tier in enumerate(self.tiers):
            if not pending:
                break
            batch = [keys[i] for i in pending]
            if bounded:
                answers = self._tier_lookup(position, batch, exact=exact)
            else:  # exact counts (remove): no deadline, and a tier that fails answers absent
                try:
                    answers = tier.lookup(batch)
                except Exception:
                    answers = [False] * len(batch)
            pending = [i for i, hit in zip(pending, answers, strict=True) if not hit]
            for i in set(range(len(keys))) - set(pending):
                present[i] = True
            if stop_early and not pending:
                break
        return present

    def _fill_from_below(
        self, keys: list[Key], views: list[ShardViews]
    ) -> tuple[dict[Key, BaseException], list[int]]:
        """Loads keys through the cascade below the buffer (or from the top when there is no
        buffer), then promotes and repairs. Used by the load path's loader threads."""
        failures, served_by, broken = self._cascade_load(keys, views, self._start)
        self._write_up(keys, views, served_by, broken)
        return failures, served_by

    def _cascade_load(
        self, keys: list[Key], views: Sequence[ShardViews], start_tier: int = 0
    ) -> tuple[dict[Key, BaseException], list[int], list[set[int]]]:
        """Loads each key from the first tier that has it. Returns failures, per key the
        position of the tier that served it (-1 if none), and per key the positions that
        failed it with an error other than a plain miss (corrupt data, I/O error)."""
        served_by = [-1] * len(keys)
        broken: list[set[int]] = [set() for _ in keys]
        last_error: dict[int, BaseException] = {}
        pending = list(range(len(keys)))
        for position in range(start_tier, len(self.tiers)):
            if not pending:
                break
            tier = self.tiers[position]
            guard = self._guards[position]
            if guard is not None and guard.skips():
                continue  # an open breaker: a miss in this tier, not a wait on it
            try:
                outcomes: Sequence[Outcome] = tier.load(
                    [keys[i] for i in pending], [views[i] for i in pending]
                )
            except Exception as exc:  # a tier that raises fails its whole batch, not the task
                outcomes = [exc] * len(pending)
            still = []
            for i, outcome in zip(pending, outcomes, strict=True):
                if outcome is None:
                    served_by[i] = position
                else:
                    if not isinstance(outcome, KeyMissingError):
                        last_error[i] = outcome
                        broken[i].add(position)
                        self._count(f"tier{position}_errors")
                    still.append(i)
            pending = still
        failures: dict[Key, BaseException] = {}
        for i in pending:
            failures[keys[i]] = last_error.get(
                i, KeyMissingError(f"not found in any of the {len(self.tiers)} tier(s)")
            )
        return failures, served_by, broken

    def _write_up(
        self,
        keys: list[Key],
        views: Sequence[ShardViews],
        served_by: list[int],
        broken: list[set[int]],
    ) -> None:
        """Writes keys served from below into the tiers above that should hold them: the top
        tier (promotion; the buffer's owner rank fills its slot itself), ``promote: true``
        tiers, and every tier that failed the key with an error other than a miss (repair: a
        torn or corrupt copy is replaced by the good one)."""
        for position in range(len(self.tiers) - 1):
            tier = self.tiers[position]
            if position == 0 and self._buffer is not None:
                continue
            tier_config = tier.config
            writable = not (
                isinstance(tier_config, LowerTierConfig) and tier_config.write == "none"
            )
            promote = position == 0 or (
                isinstance(tier_config, LowerTierConfig) and tier_config.promote
            )
            repair = [
                i
                for i, served in enumerate(served_by)
                if served > position and position in broken[i]
            ]
            chosen = sorted(
                {i for i, served in enumerate(served_by) if served > position and promote}
                | (set(repair) if writable else set())
            )
            if not chosen:
                continue
            try:
                outcomes: Sequence[Outcome] = tier.dump(
                    [keys[i] for i in chosen], [views[i] for i in chosen]
                )
            except Exception as exc:
                outcomes = [exc] * len(chosen)
            written = {i for i, o in zip(chosen, outcomes, strict=True) if o is None}
            repaired = sum(1 for i in repair if i in written)
            self._count("repaired_shards", repaired)
            self._count("promoted_shards", len(written) - repaired)

    def _write_back_targets(self, position: int) -> tuple[list[int], list[int]]:
        """The `write: back` tiers below `position` that a shard leaving it would otherwise
        lack: those above the first `write: through` tier below it, which holds every dump
        already (its own evictions feed the back tiers under it). Returns (written, gated):
        a gated `write: back` tier (an admit: condition) is skipped: it gets a shard at its
        admission only, so a debt paid without it drops the shard there (ucm.admission)."""
        back: list[int] = []
        gated_back: list[int] = []
        for i in range(position + 1, len(self.config.tiers)):
            tier_config = self.config.tiers[i]
            if not isinstance(tier_config, LowerTierConfig):
                continue
            if tier_config.write == "through" and tier_config.admit.always:
                break  # a gated through tier does not hold every dump: look further down
            if tier_config.write == "back":
                (back if tier_config.admit.always else gated_back).append(i)
        return back, gated_back

    def _evict_sink_for(
        self, position: int
    ) -> Callable[[Sequence[Key], Sequence[ShardViews]], Sequence[Outcome]] | None:
        back, gated_back = self._write_back_targets(position)
        if not back and not gated_back:
            return None

        # The buffer's sink is settled by the buffer (it knows when it took its slots); a
        # lower tier's evictions are settled here (ucm.finality).
        settles = not (position == 0 and isinstance(self.config.tiers[0], BufferTierConfig))

        def sink(keys: Sequence[Key], views: Sequence[ShardViews]) -> Sequence[Outcome]:
            results: list[Outcome] = [None] * len(keys)
            since = self._finality.start() if settles else 0
            if self._admission is not None:
                for i in gated_back:
                    self._admission.declined(i, len(keys))
            for i in back:
                outcomes = self.tiers[i].dump(keys, views)
                for j, outcome in enumerate(outcomes):
                    if outcome is not None:
                        results[j] = outcome
            if back:
                self._count("written_back_shards", sum(1 for r in results if r is None))
                if settles:
                    self._finality.settle(since, keys, forced_remove([self.tiers[i] for i in back]))
            return results

        return sink

    def _write_back_remove_for(self, position: int) -> Callable[[Sequence[Key]], None] | None:
        """What undoes the sink of ``position`` (:data:`ucm.tier.WriteBackRemove`): a forced
        remove of the keys from every tier that sink writes to. A flusher calls it for shards
        removed from the buffer while it wrote them down, so that a purge stays final."""
        back, _gated = self._write_back_targets(position)
        if not back:
            return None

        def remove(keys: Sequence[Key]) -> None:
            for i in back:
                self.tiers[i].batched_remove(keys, force=True)

        return remove


class _UnscopedCompletion:
    """A task's completion whose failures name the caller's block ids (not the scoped ids
    the tiers store): what a caller matches a TaskError's keys against."""

    __slots__ = ("_ids", "_inner")

    def __init__(self, inner: Any, ids: dict[bytes, bytes]) -> None:
        self._inner = inner
        self._ids = ids

    def done(self) -> bool:
        return bool(self._inner.done())

    def failures(self, timeout: float | None) -> dict[Key, BaseException]:
        failures: dict[Key, BaseException] = self._inner.failures(timeout)
        return {(self._ids.get(key[0], key[0]), key[1]): exc for key, exc in failures.items()}


def _unscoped(task: Task, ids: dict[bytes, bytes] | None) -> Task:
    """``task`` as its caller sees it: keys and failures by the caller's block ids."""
    if ids is None:
        return task
    keys = [(ids.get(block_id, block_id), shard) for block_id, shard in task.keys]
    return Task(task.kind, keys, _UnscopedCompletion(task.completion, ids))


_NATIVE_STORE_COUNTERS = (
    "load_tasks",
    "hits",
    "misses",
    "loaded_shards",
    "dumped_shards",
    "failed_shards",
    "prefetched_shards",
    "takeovers",
    "prewarmed",
    "get_ns",
    "get_keys",
)
"""Counters of the native queue that are the store's own (its loads, dumps, prefetches)."""


def _read_records(tier: Tier, names: list[bytes]) -> list[int | None]:
    return list(tier.read_control(names))


def _raise_record(tier: Tier, name: bytes, value: int) -> bool:
    tier.raise_control(name, value)
    return True  # the guard's "no answer" is None


def _control_names(names: Any) -> list[bytes]:
    if isinstance(names, (bytes, str)) or not isinstance(names, Sequence):
        raise InvalidArgumentError(
            f"names={arguments.short(names)} is not valid: expected a list of 16-byte names"
        )
    for index, name in enumerate(names):
        if not isinstance(name, bytes) or len(name) != CONTROL_NAME_BYTES:
            raise InvalidArgumentError(
                f"names[{index}]={arguments.short(name)} is not valid: a control record's "
                f"name is {CONTROL_NAME_BYTES} bytes"
            )
    return list(names)


def _check_rank(device_id: Any, local_rank_size: Any) -> None:
    if not isinstance(device_id, int) or isinstance(device_id, bool):
        raise InvalidArgumentError(
            f"device_id must be an int (>= 0 for a worker rank, < 0 for the scheduler), got "
            f"{device_id!r}"
        )
    if not isinstance(local_rank_size, int) or isinstance(local_rank_size, bool):
        raise InvalidArgumentError(f"local_rank_size must be an int >= 1, got {local_rank_size!r}")
    if local_rank_size < 1:
        raise InvalidArgumentError(f"local_rank_size must be >= 1, got {local_rank_size}")


def _check_task(task: Any) -> None:
    if not isinstance(task, Task):
        raise InvalidArgumentError(
            f"task must be a ucm Task returned by load/dump, got {type(task).__name__}"
        )


def open_store(
    stack: str | os.PathLike[str] | Mapping[str, Any] | StackConfig,
    device_id: int = 0,
    local_rank_size: int = 1,
    **options: Any,
) -> Store:
    """Opens a store for one rank: ``ucm.open("stack.yaml", device_id=0, local_rank_size=4)``.
    ``stack``: the path of a YAML file (``str`` or ``os.PathLike``), a mapping of its contents,
    or a :class:`StackConfig`; ``options``: ``namespace``."""
    _check_stack(stack)
    unknown = sorted(set(options) - _OPEN_OPTIONS)
    if unknown:
        raise InvalidArgumentError(
            f"ucm.open got an unknown option {unknown[0]}={arguments.short(options[unknown[0]])}: "
            "its options are device_id, local_rank_size and namespace"
        )
    return Store(load_stack(stack), device_id=device_id, local_rank_size=local_rank_size, **options)


_OPEN_OPTIONS = frozenset({"namespace"})
"""The keyword options of :func:`open_store` beyond the rank's (those of :class:`Store`)."""


def _check_stack(stack: Any) -> None:
    """``stack`` of ``ucm.open``: a str path, an os.PathLike giving a str, a mapping or a
    StackConfig (a bytes path, say, would fail deep in pathlib)."""
    if isinstance(stack, str | Mapping | StackConfig):
        return
    if isinstance(stack, os.PathLike) and isinstance(os.fspath(stack), str):
        return
    raise InvalidArgumentError(
        f"stack must be the path of a YAML file (str or os.PathLike), a mapping or a "
        f"ucm.StackConfig, got {type(stack).__name__} {arguments.short(stack)}"
    )


def _namespace_bytes(config: StackConfig, label: str) -> NamespaceBytes | None:
    """The byte quotas of ``quotas:`` for the tier labelled ``label``, or None when none
    applies to it."""
    quotas = config.quotas
    if quotas is None or (config.buffer is not None and label == config.buffer.label):
        return None
    named = {
        name: quota.tiers[label]
        for name, quota in quotas.namespaces.items()
        if label in quota.tiers
    }
    others = quotas.others.tiers.get(label)
    if not named and others is None:
        return None
    return NamespaceBytes(named=named, others=others)
