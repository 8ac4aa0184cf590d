"""The worker side of the connector (one per TP rank): loads into vLLM's KV cache tensors
before the forward pass, dumps after it, and which requests' blocks vLLM may free. No engine
needed: it works on a store and one block-contiguous tensor view per layer. A CPU KV cache is
transferred through addresses (each layer's base and block stride, checked once at
registration: :class:`~ucm.integration.addresses.BlockAddresses`), a CUDA one through the
tensor views."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ucm.errors import TaskError
from ucm.native.copy import copy_ranges
from ucm.threadname import enter_thread

from ..addresses import BlockAddresses
from ..bounded import Staging, StagingSlots, keep_late, reap_late
from .metadata import BlockTransfer, UcmConnectorMetadata, UcmWorkerMetadata
from .metrics import UcmConnectorStats

if TYPE_CHECKING:
    import torch

    from ucm.store import Pin, Store
    from ucm.task import Task

logger = logging.getLogger("vllm.ucm")


@dataclass(eq=False)
class _PendingSave:
    """One step's dump. Straight from a CPU KV cache's blocks (a CacheBuffer's stack), the
    dump reads them until its task is done. From a CUDA KV cache, ``store.dump`` has copied
    the blocks into its pinned staging slots before it returned (``ucm.staging``: the task
    waits on that copy's event), so the blocks are read no more once it is submitted
    (``copied`` is set then). *Staged* (a CPU KV cache, and no CacheBuffer or one that
    writes back, where a dump may wait for a tier: ``WorkerSide(stage_saves=True)``): the
    worker's saving thread copies the blocks into private staging memory (one native call),
    and its submitting thread submits the dump of that memory (``copy``), so vLLM's blocks
    are read only until the copy is over, however long the tier takes to write."""

    task: Task | None
    """The dump; for a staged save, None until the submitting thread submitted it."""
    requests: set[str]
    ids: list[bytes]
    vllm_blocks: list[int]
    """The vLLM blocks the dump reads: none may be reused until it is done (or copied)."""
    finished: bool = False
    overdue: bool = False
    """A load already waited the load deadline for it: later loads do not wait again."""
    copy: Future[Task] | None = None
    """A staged save's copy into its staging ``slots`` (the saving thread), then the dump's
    submission (the submitting thread, so that no copy waits behind a submission to a full
    dump queue); its result is the dump task. ``copied`` is set as soon as the copy is over."""
    copied: threading.Event | None = None
    slots: list[int] | None = None
    """A staged save's slots of the worker's :class:`~ucm.integration.bounded.StagingSlots`,
    until the dump is over."""
    blocks_free: bool = False
    """vLLM's blocks are read no more: counted off ``_dumping`` (get_finished may report)."""


@dataclass(eq=False)
class _AsyncLoad:
    """One request's asynchronous load, in two phases that both run beside the forward
    passes: its blocks are moved up into the CacheBuffer (the prefetch), then, once there (or
    once the deadline passed), the ones the buffer holds are pinned and copied into vLLM's
    blocks by the native copy threads. The request is reported in ``finished_recving`` when
    that copy is over: vLLM keeps its blocks until then, even if it is aborted.

    A *direct* load (``WorkerSide(direct_async=True)``: no CacheBuffer) has no CacheBuffer
    to stage in: one load task reads the blocks from the tiers into private memory
    (``staging``), submitted once this rank's dumps of its blocks are over, and the blocks
    that arrived by ``deadline`` are copied from there into vLLM's blocks (``placing``, on
    the worker's placing thread). Past the deadline the load is over with every block
    failed; its task goes on into the staging memory only, which is kept until it ends
    (``ucm.integration.bounded.keep_late``), never into a block vLLM recomputes or reuses."""

    req_id: str
    group: list[tuple[bytes, int]]
    """(UCM id, vLLM block) of each block."""
    prefetch: Task | None
    """None: nothing to move up (already in the CacheBuffer), or the prefetch failed to start."""
    deadline: float
    """``time.monotonic()`` past which blocks not in the CacheBuffer are reported failed."""
    started: float = 0.0
    """``time.perf_counter()`` at the start of the load (load_seconds: start to copy end)."""
    copy: Task | None = None
    """The copy into vLLM's blocks, once submitted (``copying``)."""
    copying: bool = False
    """The second phase started: ``pins`` are held and ``held`` is what ``copy`` writes."""
    late: bool = False
    """The prefetch had not finished by the deadline."""
    pins: list[Pin] = field(default_factory=list)
    held: list[tuple[bytes, int]] = field(default_factory=list)
    """The (UCM id, vLLM block) pairs whose every shard the pins hold: the ones copied (for
    a direct load: the ones its task loads)."""
    direct: bool = False
    """A direct load (above)."""
    after_dumps: bool = False
    """Its prefetch waits for this rank's dumps of its blocks (started by ``advance_async``
    once they are over; past the deadline, the blocks the CacheBuffer holds are copied)."""
    staging: Staging | None = None
    """A direct load's private memory: ``held[n]`` is loaded into ``staging.addresses[n]``."""
    placing: Future[None] | None = None
    """A direct load's copy of what arrived in time from ``staging`` into vLLM's blocks."""


def unique_key_groups(loads: Iterable[BlockTransfer]) -> list[list[tuple[bytes, int]]]:
    """The step's (UCM id, vLLM block) pairs split into tasks without a repeated id (two
    requests of one step may load the same block into two vLLM blocks)."""
    groups: list[list[tuple[bytes, int]]] = []
    seen: list[set[bytes]] = []
    for transfer in loads:
        for vllm_block, block_id in zip(transfer.vllm_blocks, transfer.ucm_ids, strict=True):
            for index, ids in enumerate(seen):
                if block_id not in ids:
                    ids.add(block_id)
                    groups[index].append((block_id, vllm_block))
                    break
            else:
                seen.append({block_id})
                groups.append([(block_id, vllm_block)])
    return groups


class WorkerSide:
    """The connector's worker-role state machine (see the package docstring)."""

    def __init__(
        self,
        store: Store,
        *,
        rank: int,
        shard_size: int,
        stats: UcmConnectorStats | None = None,
        load_deadline_s: float = 10.0,
        hits_only: bool = False,
        direct_async: bool = False,
        stage_saves: bool = False,
    ) -> None:
        self._store = store
        self._direct_async = direct_async
        """Asynchronous loads read into staging memory, not a CacheBuffer (:class:`_AsyncLoad`)."""
        self._load_deadline_s = load_deadline_s
        self._hits_only = hits_only
        """The scheduler loads asynchronously whatever is not all in the CacheBuffer, so a
        synchronous load is of buffer hits: a block evicted since the look-up fails (vLLM
        recomputes it) rather than being read from below before the forward pass."""
        self._async: list[_AsyncLoad] = []
        """Asynchronous loads not reported in finished_recving yet."""
        self._rank = rank
        self._shard_size = shard_size
        self.stats = stats if stats is not None else UcmConnectorStats()
        self._block_views: list[torch.Tensor] = []
        self._addresses: BlockAddresses | None = None
        self._invalid: set[int] = set()
        self._saves: list[_PendingSave] = []
        self._dumping: Counter[str] = Counter()
        """Per request, dump tasks in flight."""
        self._bound: UcmConnectorMetadata | None = None
        """The step's metadata while its saves are not submitted yet."""
        self._released: set[str] = set()
        """Requests the scheduler released and get_finished has not reported yet."""
        self._loaded_steps: set[int] = set()
        self._dumped: Counter[bytes] = Counter()
        self._dump_failed: set[bytes] = set()
        """Dumps finished since the last step's worker metadata (see UcmWorkerMetadata)."""
        self._placer: ThreadPoolExecutor | None = None
        """Copies direct loads from their staging memory into vLLM's blocks, off the step."""
        self._stage_saves = stage_saves
        """Saves go through staging memory when the KV cache has addresses (a CPU one; see
        :class:`_PendingSave`): the connector asks for it when a dump may wait for a tier."""
        self._saver: ThreadPoolExecutor | None = None
        """Copies staged saves out of vLLM's blocks, off the step."""
        self._submitter: ThreadPoolExecutor | None = None
        """Submits staged saves' dumps in order (each may wait ``dump_submit_timeout_s`` on a
        full dump queue), and gives the pages of staging slots past the warm bound back to
        the system."""
        self._save_slots: StagingSlots | None = None
        """Staged saves' memory: one slot per block, as many as the KV cache has blocks."""
        self._copied_at_submit = False
        """A CUDA KV cache: a dump has copied vLLM's blocks by the time it is submitted."""
        self._closing = False
        """:meth:`close` began: a staged save's submission that times out drops the rest."""
        self._close_refused = False
        """A staged save's submission timed out on a full dump queue while closing: the tier
        does not keep up, and the saves behind it are dropped, not waited for one by one."""
        self._dropped_at_close = 0
        """Blocks of staged saves dropped at close, unsubmitted."""

    def set_block_views(
        self, views: list[torch.Tensor], addresses: BlockAddresses | None = None
    ) -> None:
        """One tensor per stored layer, ``view[b]`` = vLLM block b of that layer, contiguous.
        With ``addresses`` (the same views, checked: a CPU KV cache), every transfer goes
        through ``load_data``/``dump_data`` with the step's addresses in one array."""
        self._block_views = views
        self._addresses = addresses
        self._copied_at_submit = bool(views) and views[0].device.type == "cuda"
        if self._stage_saves and addresses is not None and self._save_slots is None:
            self._save_slots = StagingSlots.reserve(
                self._store.layout,
                addresses.blocks,
                "blocks of the KV cache",
                "a save that finds every slot taken by the saves in flight is skipped",
            )

    def _load_task(
        self,
        ids: list[bytes],
        vllm_blocks: list[int],
        background: bool = False,
    ) -> Task:
        """``background``: an asynchronous load's copy, which no step waits on. A load reads
        from below unless synchronous ones are of CacheBuffer hits (``hits_only``)."""
        fill = not self._hits_only
        addresses = self._addresses
        if addresses is not None:
            return self._store.load_data(
                ids,
                self._rank,
                addresses.of(vllm_blocks),
                background=background,
                fill=fill,
            )
        return self._store.load(
            ids,
            self._rank,
            self._block_tensors(vllm_blocks),
            background=background,
            fill=fill,
        )

    def _dump_task(self, ids: list[bytes], vllm_blocks: list[int]) -> Task:
        addresses = self._addresses
        if addresses is not None:
            return self._store.dump_data(ids, self._rank, addresses.of(vllm_blocks))
        return self._store.dump(ids, self._rank, self._block_tensors(vllm_blocks))

    def _block_tensors(self, vllm_blocks: list[int]) -> list[list[torch.Tensor]]:
        return [[view[block] for view in self._block_views] for block in vllm_blocks]

    def bind(self, meta: UcmConnectorMetadata) -> None:
        """A step's metadata arrived: its released requests wait for its saves, which
        :meth:`submit_saves` submits (after the forward pass) whatever hook calls it."""
        if self._bound is not None:  # a step whose dumps no hook submitted
            self.submit_saves()
        self._released |= meta.released
        self._bound = meta if meta.saves else None

    def handle_preemptions(self, meta: UcmConnectorMetadata) -> None:
        """The preempted requests' blocks are free from this step on: every dump still
        reading them must be over with them before the forward pass can write into them. A
        staged save reads them only for its copy into staging memory (a memcpy: the wait is
        bounded by memory bandwidth, never by a tier), a CUDA dump not at all once submitted,
        a dump straight from a CPU KV cache's blocks (a CacheBuffer's stack, where it ends
        once in the buffer) until it is done."""
        preempted = meta.preempted
        if not preempted:
            return
        for pending in list(self._saves):
            if not pending.requests & preempted:
                continue
            if pending.copied is not None:
                pending.copied.wait()
            else:
                self._finish_save(pending)
        self._reap_saves()

    def start_load(self, meta: UcmConnectorMetadata) -> None:
        if meta.async_loads:
            self._start_async(meta)
        if self._async:
            self.advance_async()
        if not meta.loads:
            return
        # This step's output carries the failures (load_errors): the scheduler learns from
        # it which loads held.
        self._loaded_steps.add(meta.step)
        started = time.perf_counter()
        wanted = {block_id for transfer in meta.loads for block_id in transfer.ucm_ids}
        dumping = self._finish_saves_of(wanted)
        submitted: list[tuple[Task | None, list[tuple[bytes, int]]]] = []
        for whole in unique_key_groups(meta.loads):
            group = [pair for pair in whole if pair[0] not in dumping]
            if len(group) < len(whole):  # still being dumped past the deadline: recomputed
                submitted.append((None, [pair for pair in whole if pair[0] in dumping]))
            if not group:
                continue
            ids = [block_id for block_id, _ in group]
            try:
                task = self._load_task(ids, [vllm_block for _, vllm_block in group])
            except Exception as exc:
                logger.warning("UCM load of %d blocks not submitted: %s", len(ids), exc)
                submitted.append((None, group))
            else:
                submitted.append((task, group))
        # The loads finish before the forward pass: vLLM writes this step's new KV into the same
        # blocks' free rows (a prompt whose last block was loaded), and attention reads them.
        for pending_load, group in submitted:
            failed = self._wait_load(pending_load, group)
            self._invalid.update(vllm_block for block_id, vllm_block in group if block_id in failed)
            loaded = len(group) - len([1 for block_id, _ in group if block_id in failed])
            self.stats.data["loaded_blocks"] += loaded
            self.stats.data["loaded_bytes"] += loaded * self._shard_size
            self.stats.data["load_failed_blocks"] += len(group) - loaded
        self.stats.data["load_seconds"] += time.perf_counter() - started

    def _start_async(self, meta: UcmConnectorMetadata) -> None:
        if self._direct_async:
            self._start_direct(meta)
        else:
            self._start_prefetches(meta)

    def _start_direct(self, meta: UcmConnectorMetadata) -> None:
        """Starts each asynchronous load as one load task into the worker's staging memory
        (no CacheBuffer to stage them in; see :class:`_AsyncLoad`), reported in
        ``finished_recving`` once what loaded is copied into vLLM's blocks, or past
        ``ucm_load_deadline_s`` with every block failed: vLLM keeps the blocks until then,
        aborted or not. A load
        of blocks this rank is still dumping is submitted once those dumps are over (a later
        :meth:`advance_async`; the step never waits for them), or with those blocks failed
        once ``ucm_load_deadline_s`` passed. A load the full queue does not take at once
        fails, and vLLM recomputes its blocks."""
        deadline = time.monotonic() + self._load_deadline_s
        for transfer in meta.async_loads:
            group = list(zip(transfer.ucm_ids, transfer.vllm_blocks, strict=True))
            load = _AsyncLoad(
                transfer.req_id, group, None, deadline, time.perf_counter(), direct=True
            )
            self._async.append(load)
            self.stats.data["async_loads"] += 1
            if not self._dumps_running(group):
                self._submit_direct(load, set())

    def _dumps_running(self, group: list[tuple[bytes, int]]) -> set[bytes]:
        """The blocks of ``group`` that a dump of this rank still writes."""
        ids = {block_id for block_id, _ in group}
        running: set[bytes] = set()
        for pending in self._saves:
            if pending.finished or ids.isdisjoint(pending.ids):
                continue
            if not self.save_done(pending):
                running |= ids.intersection(pending.ids)
        return running

    def save_done(self, pending: _PendingSave) -> bool:
        """Whether the dump is over (a staged save whose copy or submission failed is)."""
        if pending.finished:
            return True
        if pending.copy is not None:
            if not pending.copy.done():
                return False
            if pending.task is None and pending.copy.exception() is not None:
                return True
            pending.task = pending.copy.result()
        assert pending.task is not None
        return self._store.check(pending.task)

    def reads_vllm_blocks(self, pending: _PendingSave) -> bool:
        """Whether the dump may still read its vLLM blocks (a staged save: until its copy is
        over; otherwise until it is done)."""
        if pending.copied is not None:
            return not pending.copied.is_set()
        return not self.save_done(pending)

    def _submit_direct(self, load: _AsyncLoad, dumping: set[bytes]) -> None:
        """Submits a direct load's task into staging memory, without the blocks still being
        dumped (failed); a load the full queue does not take at once fails whole."""
        reap_late()
        load.copying = True
        load.late = bool(dumping)
        load.held = [pair for pair in load.group if pair[0] not in dumping]
        if not load.held:
            return
        try:
            # Not populated here: the loader threads fault the pages in as they write.
            load.staging = Staging(self._store.layout, len(load.held), populate=False)
            load.copy = self._store.load_data(
                [block_id for block_id, _ in load.held],
                self._rank,
                load.staging.addresses,
                background=True,
                submit_timeout_s=0.0,  # never holds the step up
            )
        except Exception as exc:
            logger.warning("UCM load of %d blocks not submitted: %s", len(load.held), exc)
            load.held = []
            load.staging = None

    def _advance_direct(self, load: _AsyncLoad, now: float) -> None:
        """A submitted direct load: once its task is over, the copy of the blocks that loaded
        into vLLM's blocks starts (off the step); past the deadline with the task still
        running, the load is over with every block late, and its staging memory is kept
        until the task ends."""
        task, staging = load.copy, load.staging
        if load.placing is not None or task is None or staging is None:
            return
        if self._store.check(task):
            failed = self._wait_load(task, load.held)
            placed = [
                (n, vllm_block)
                for n, (block_id, vllm_block) in enumerate(load.held)
                if block_id not in failed
            ]
            load.held = [pair for pair in load.held if pair[0] not in failed]
            load.copy = None
            if placed:
                if self._placer is None:
                    self._placer = ThreadPoolExecutor(
                        1, thread_name_prefix="ucm-place", initializer=enter_thread
                    )
                load.placing = self._placer.submit(self._place, staging, placed)
            else:
                load.staging = None
        elif now >= load.deadline:
            keep_late(self._store, task, staging)
            load.late = True
            load.held = []
            load.copy = None
            load.staging = None

    def _place(self, staging: Staging, placed: list[tuple[int, int]]) -> None:
        """Copies shard ``n`` of ``staging`` into vLLM block ``b`` for each (n, b) of
        ``placed`` (the placing thread: one native call for a CPU KV cache, see
        :func:`~ucm.native.copy.copy_ranges`; a host-to-device copy per tensor for CUDA)."""
        sizes = self._store.layout.tensor_sizes
        addresses = self._addresses
        if addresses is not None:
            # One native call: the GIL is released once, not once per tensor of every block
            # (each time back behind the engine's threads, up to a switch interval each).
            copy_ranges(
                addresses.of([vllm_block for _, vllm_block in placed]),
                [source for n, _ in placed for source in staging.addresses[n]],
                list(sizes) * len(placed),
            )
            return
        import torch

        memory = torch.frombuffer(staging.memory, dtype=torch.uint8)
        shard_size = self._store.layout.shard_size
        for n, vllm_block in placed:
            offset = n * shard_size
            for view, size in zip(self._block_views, sizes, strict=True):
                target = view[vllm_block].reshape(-1).view(torch.uint8)
                target.copy_(memory[offset : offset + size])
                offset += size

    def close(self) -> None:
        """Keeps the staging memory of direct loads and staged saves still running until
        they end, and waits for the copies in and out of staging (memcpys) and for the
        submissions of staged saves while the dump queue takes them: past the first that
        times out on a full queue (``dump_submit_timeout_s``), the rest are dropped."""
        self._closing = True
        for load in self._async:
            if load.copy is not None and load.staging is not None:
                keep_late(self._store, load.copy, load.staging)
        if self._placer is not None:
            self._placer.shutdown(wait=True)
        if self._saver is not None:  # first: its copies hand their dumps to the submitter
            self._saver.shutdown(wait=True)
        if self._submitter is not None:
            self._submitter.shutdown(wait=True)
        if self._dropped_at_close:
            logger.warning(
                "UCM: %d blocks not saved: the worker closed while a tier did not keep up "
                "(a full dump queue)",
                self._dropped_at_close,
            )
        for pending in self._saves:
            if pending.slots is None or pending.copy is None or pending.finished:
                continue
            if pending.copy.exception() is not None:
                continue
            task = pending.copy.result()
            if not self._store.check(task):
                assert self._save_slots is not None
                keep_late(self._store, task, self._save_slots)

    def _start_prefetches(self, meta: UcmConnectorMetadata) -> None:
        """Starts moving the blocks of the step's asynchronous loads up into the CacheBuffer.
        Nothing is written into vLLM's blocks until :meth:`finished_recving`: bytes that
        arrive after the deadline land in the CacheBuffer only, never in a vLLM block that
        the request gave up (vLLM recomputes it, or frees and reuses it).
        A load of blocks this rank is still dumping starts its prefetch once those dumps are
        over (a later :meth:`advance_async`: the prefetch then finds what they wrote), never
        waited for inside a step."""
        deadline = time.monotonic() + self._load_deadline_s
        for transfer in meta.async_loads:
            group = list(zip(transfer.ucm_ids, transfer.vllm_blocks, strict=True))
            load = _AsyncLoad(transfer.req_id, group, None, deadline, time.perf_counter())
            self._async.append(load)
            self.stats.data["async_loads"] += 1
            load.after_dumps = bool(self._dumps_running(group))
            if not load.after_dumps:
                self._start_prefetch(load)

    def _start_prefetch(self, load: _AsyncLoad) -> None:
        try:
            # Never blocks the step: with the prefetch queue full, it is not started.
            load.prefetch = self._store.prefetch(
                [block_id for block_id, _ in load.group],
                background=True,
                submit_timeout_s=0.0,
                shard_index=self._rank,  # this rank's shard: never waits on another rank's
            )
        except Exception as exc:  # copied from what is in the CacheBuffer; the rest fails
            logger.warning("UCM prefetch of %d blocks not started: %s", len(load.group), exc)

    def advance_async(self) -> None:
        """Starts the copy of each asynchronous load whose prefetch is over (finished, failed
        or past its deadline); called before the forward pass and after it, so the copy runs
        beside the next forward pass instead of inside a step."""
        now = time.monotonic()
        for load in self._async:
            if load.copying:
                if load.direct:
                    self._advance_direct(load, now)
                continue
            if load.direct:
                dumping = self._dumps_running(load.group)
                if not dumping or now >= load.deadline:
                    self._submit_direct(load, dumping)
                    self._advance_direct(load, now)
                continue
            if load.after_dumps:
                if self._dumps_running(load.group) and now < load.deadline:
                    continue
                load.after_dumps = False
                if now >= load.deadline:  # copies what the CacheBuffer holds: the rest is late
                    load.late = True
                    self._start_copy(load)
                    continue
                self._start_prefetch(load)
            done = load.prefetch is None or self._store.check(load.prefetch)
            if done or now >= load.deadline:
                load.late = not done
                self._start_copy(load)

    def finished_recving(self) -> set[str]:
        """The requests whose asynchronous load is over, each reported once: its blocks that
        reached the CacheBuffer were copied into vLLM's blocks (pinned there, so the copy is a
        hit: one memcpy), the others are load errors that vLLM recomputes. The copy of a load
        whose prefetch just ended is started here and reported at a later step, once the copy
        threads finished it."""
        if not self._async:
            return set()
        self.advance_async()
        over = [load for load in self._async if self._over(load)]
        if not over:
            return set()
        self._async = [load for load in self._async if load not in over]
        for load in over:
            self._finish_async(load)
        return {load.req_id for load in over}

    def _over(self, load: _AsyncLoad) -> bool:
        """Whether the load is over: its copy into vLLM's blocks finished, or never started."""
        if not load.copying:
            return False
        if load.direct:
            return load.copy is None and (load.placing is None or load.placing.done())
        return load.copy is None or self._store.check(load.copy)

    def _start_copy(self, load: _AsyncLoad) -> None:
        """The second phase: pins what the CacheBuffer holds of this rank's shards of the
        load's blocks and submits their copy into vLLM's blocks (it never reaches a lower
        tier: every shard it copies is pinned). With TP > 1 each rank judges its own shards;
        vLLM recomputes a block any rank reports failed."""
        load.copying = True
        ids = [block_id for block_id, _ in load.group]
        try:
            load.pins = self._store.pin(ids, shard_index=self._rank)
        except Exception as exc:
            logger.warning("UCM: could not pin %d loaded blocks: %s", len(ids), exc)
            return
        load.held = [pair for pair, pin in zip(load.group, load.pins, strict=False) if pin.held]
        if not load.held:
            return
        # One that is not submitted leaves nothing held: every block of the load then fails.
        try:
            load.copy = self._load_task(
                [block_id for block_id, _ in load.held],
                [vllm_block for _, vllm_block in load.held],
                background=True,
            )
        except Exception as exc:
            logger.warning("UCM load of %d blocks not submitted: %s", len(load.held), exc)
            load.held = []

    def _finish_async(self, load: _AsyncLoad) -> None:
        """Collects a load whose copy is over (or never started): releases its pins and marks
        every block it did not copy as a load error."""
        ids = [block_id for block_id, _ in load.group]
        if load.placing is not None:
            try:
                load.placing.result()
            except Exception as exc:
                logger.warning("UCM: copying %d loaded blocks failed: %s", len(load.held), exc)
                load.held = []
            load.placing = None
            load.staging = None
        try:
            copied = {block_id for block_id, _ in load.held}
            if load.copy is not None:
                copied -= self._wait_load(load.copy, load.held)
        finally:
            if load.pins:
                self._store.unpin(load.pins)
        failed = set(ids) - copied
        if failed:
            logger.warning(
                "UCM: %d of %d blocks of request %s %s; vLLM recomputes them",
                len(failed),
                len(ids),
                load.req_id,
                "missed the load deadline" if load.late else "failed to load",
            )
        self._invalid.update(
            vllm_block for block_id, vllm_block in load.group if block_id in failed
        )
        loaded = len(ids) - len(failed)
        self.stats.data["loaded_blocks"] += loaded
        self.stats.data["loaded_bytes"] += loaded * self._shard_size
        self.stats.data["load_failed_blocks"] += len(failed)
        if load.late:
            self.stats.data["load_late_blocks"] += len(failed)
        self.stats.data["load_seconds"] += time.perf_counter() - load.started

    def _wait_load(self, task: Task | None, group: list[tuple[bytes, int]]) -> set[bytes]:
        """The ids of the group's blocks that did not load."""
        every = {block_id for block_id, _ in group}
        if task is None:
            return every
        try:
            self._store.wait(task)
        except TaskError as exc:
            failed = {block_id for block_id, _shard in exc.failures}
            logger.warning(
                "UCM: %d of %d blocks failed to load; vLLM recomputes them: %s",
                len(failed),
                len(group),
                exc,
            )
            return failed
        except Exception as exc:
            logger.warning(
                "UCM: a load of %d blocks failed; vLLM recomputes them: %s", len(group), exc
            )
            return every
        return set()

    def submit_saves(self) -> None:
        """Submits the bound step's dumps, once (``wait_for_save``, or the metadata's clearing
        when vLLM skipped ``wait_for_save``), and returns: no forward pass waits for a dump."""
        self._reap_saves()
        meta, self._bound = self._bound, None
        if meta is None:
            return
        requests: set[str] = set()
        seen: set[bytes] = set()
        ids: list[bytes] = []
        blocks: list[int] = []
        for transfer in meta.saves:
            requests.add(transfer.req_id)
            for vllm_block, block_id in zip(transfer.vllm_blocks, transfer.ucm_ids, strict=True):
                if block_id in seen:  # two requests of one step filled the same block
                    continue
                seen.add(block_id)
                ids.append(block_id)
                blocks.append(vllm_block)
        if self._stage_saves and self._addresses is not None:
            self._submit_staged(requests, ids, blocks)
            return
        try:
            task = self._dump_task(ids, blocks)
        except Exception as exc:
            logger.warning("UCM dump of %d blocks not submitted: %s", len(ids), exc)
            self.stats.data["save_failed_blocks"] += len(ids)
            self._dump_failed.update(ids)
            return
        pending = _PendingSave(task=task, requests=requests, ids=ids, vllm_blocks=blocks)
        self._saves.append(pending)
        self._dumping.update(requests)
        if self._copied_at_submit:
            pending.copied = threading.Event()
            pending.copied.set()
            self._free_blocks(pending)

    def _submit_staged(self, requests: set[str], ids: list[bytes], blocks: list[int]) -> None:
        """A staged save (:class:`_PendingSave`): the saving thread copies ``blocks`` into
        staging slots, and the submitting thread submits their dump from there. The slots
        are reused from save to save (warm memory: no page faults in the copy), and there
        are as many as the KV cache has blocks: past them (a tier that does not keep up),
        the save is skipped, counted as failed, and never waited for."""
        assert self._addresses is not None and self._save_slots is not None
        slots = self._save_slots.take(len(ids))
        if slots is None:
            logger.warning(
                "UCM: %d blocks not saved: the dumps in flight already hold %d of the %d "
                "blocks of staging memory, the size of the KV cache (the tier does not keep "
                "up)",
                len(ids),
                self._save_slots.held,
                self._save_slots.capacity,
            )
            self.stats.data["save_failed_blocks"] += len(ids)
            self._dump_failed.update(ids)
            return
        addresses = self._save_slots.addresses(slots)
        copied = threading.Event()
        destinations = [address for shard in addresses for address in shard]
        sources = self._addresses.of(blocks)
        if self._saver is None or self._submitter is None:
            self._saver = ThreadPoolExecutor(
                1, thread_name_prefix="ucm-save", initializer=enter_thread
            )
            self._submitter = ThreadPoolExecutor(
                1, thread_name_prefix="ucm-save-submit", initializer=enter_thread
            )
        copy: Future[Task] = Future()
        self._saver.submit(self._stage_copy, ids, sources, destinations, addresses, copied, copy)
        self._saves.append(
            _PendingSave(
                task=None,
                requests=requests,
                ids=ids,
                vllm_blocks=blocks,
                copy=copy,
                copied=copied,
                slots=slots,
            )
        )
        self._dumping.update(requests)

    def _stage_copy(
        self,
        ids: list[bytes],
        sources: Sequence[int],
        destinations: list[int],
        addresses: list[list[int]],
        copied: threading.Event,
        submitted: Future[Task],
    ) -> None:
        """The saving thread: copies a save's blocks into its staging memory, then hands the
        dump of that memory to the submitting thread (``submitted`` gets the dump task)."""
        try:
            sizes = list(self._store.layout.tensor_sizes)
            copy_ranges(destinations, sources, sizes * len(ids))
        except Exception as exc:
            submitted.set_exception(exc)
            return
        finally:
            copied.set()  # vLLM's blocks are read no more (an error leaves them unread too)
        assert self._submitter is not None
        try:
            self._submitter.submit(self._submit_staged_dump, ids, addresses, submitted)
        except RuntimeError as exc:  # the worker closed
            submitted.set_exception(exc)

    def _submit_staged_dump(
        self, ids: list[bytes], addresses: list[list[int]], submitted: Future[Task]
    ) -> None:
        """The submitting thread: submits a staged save's dump (waiting at most
        ``dump_submit_timeout_s`` on a full dump queue). Once one timed out while the worker
        closes, the saves still queued here are dropped: a close never waits
        ``dump_submit_timeout_s`` for each save behind a tier that does not keep up."""
        if self._close_refused:
            self._dropped_at_close += len(ids)
            submitted.set_exception(RuntimeError("the worker closed before the dump's submission"))
            return
        try:
            submitted.set_result(self._store.dump_data(ids, self._rank, addresses))
        except TimeoutError as exc:
            if self._closing:
                self._close_refused = True
            submitted.set_exception(exc)
        except Exception as exc:
            submitted.set_exception(exc)

    def _finish_saves_of(self, wanted: set[bytes]) -> set[bytes]:
        """Waits for this rank's dumps of any of ``wanted`` (a load must find what the dump
        writes), all of them within the load deadline (``ucm_load_deadline_s``), once: a dump
        held up by a slow tier never holds a step up longer, nor a second step at all. Returns
        the wanted blocks whose dump is still running then; the caller reports them failed,
        and vLLM recomputes them."""
        deadline = time.monotonic() + self._load_deadline_s
        running: set[bytes] = set()
        for pending in self._saves:
            if pending.finished or wanted.isdisjoint(pending.ids):
                continue
            left = 0.0 if pending.overdue else max(deadline - time.monotonic(), 0.0)
            if not self._finish_save(pending, left):
                pending.overdue = True
                running |= wanted.intersection(pending.ids)
        if running:
            logger.warning(
                "UCM: %d blocks to load were still being dumped by this rank after %.1f s "
                "(ucm_load_deadline_s); vLLM recomputes them",
                len(running),
                self._load_deadline_s,
            )
        return running

    def _reap_saves(self) -> None:
        for pending in self._saves:
            if pending.copied is not None and pending.copied.is_set():
                self._free_blocks(pending)
            if self.save_done(pending):
                self._finish_save(pending)
        self._saves = [pending for pending in self._saves if not pending.finished]

    def _free_blocks(self, pending: _PendingSave) -> None:
        """The dump reads the requests' vLLM blocks no more: they may be reported finished."""
        if pending.blocks_free:
            return
        pending.blocks_free = True
        self._dumping.subtract(pending.requests)
        for req_id in pending.requests:
            if self._dumping[req_id] <= 0:
                del self._dumping[req_id]

    def _finish_save(self, pending: _PendingSave, timeout_s: float | None = None) -> bool:
        """Collects a dump, waiting for it up to ``timeout_s`` (None: until it is done);
        whether it is finished."""
        if pending.finished:
            return True
        end = None if timeout_s is None else time.monotonic() + timeout_s
        failed: set[bytes] = set()
        task = pending.task
        if task is None and pending.copy is not None:  # a staged save not submitted yet
            try:
                task = pending.task = pending.copy.result(timeout_s)
            except FutureTimeoutError:
                return False
            except Exception as exc:
                failed = set(pending.ids)
                logger.warning("UCM: a dump of %d blocks not submitted: %s", len(pending.ids), exc)
        if task is not None:
            collected = self._collect_dump(pending, task, end)
            if collected is None:
                return False
            failed = collected
        pending.finished = True
        if pending.slots is not None:
            self._give_slots(pending.slots)
            pending.slots = None
        saved = len(pending.ids) - len(failed)
        self.stats.data["saved_blocks"] += saved
        self.stats.data["saved_bytes"] += saved * self._shard_size
        self.stats.data["save_failed_blocks"] += len(failed)
        self._dumped.update(block_id for block_id in pending.ids if block_id not in failed)
        self._dump_failed |= failed
        self._free_blocks(pending)
        return True

    def _give_slots(self, slots: list[int]) -> None:
        """Frees a finished staged save's slots; the submitting thread gives the pages of those
        past the warm bound back to the system (never the step's thread: it takes time)."""
        assert self._save_slots is not None and self._submitter is not None
        cold = self._save_slots.give(slots)
        if cold:
            with contextlib.suppress(RuntimeError):  # closed: the slots are not needed again
                self._submitter.submit(self._save_slots.trim, cold)

    def _collect_dump(
        self, pending: _PendingSave, task: Task, end: float | None
    ) -> set[bytes] | None:
        """The ids of the dump's blocks that failed, once it is done (by ``end``, if given:
        None when it is still running then)."""
        if end is not None and not self._store.check(task):
            try:
                self._store.wait(task, max(end - time.monotonic(), 0.0))
            except TimeoutError:
                return None
            except Exception:  # failed: collected below
                pass
            if not self._store.check(task):
                return None
        failed: set[bytes] = set()
        try:
            self._store.wait(task)  # at once when reaped or waited; blocks otherwise
        except TaskError as exc:
            failed = {block_id for block_id, _shard in exc.failures}
            logger.warning(
                "UCM: %d of %d blocks failed to save: %s", len(failed), len(pending.ids), exc
            )
        except Exception as exc:
            failed = set(pending.ids)
            logger.warning("UCM: a dump of %d blocks failed: %s", len(pending.ids), exc)
        return failed

    def get_finished(self) -> set[str]:
        """The released requests none of whose saves is unsubmitted or still reads their
        blocks (in flight from them; a staged save: its copy not over): each is returned
        once. vLLM's ``finished_req_ids`` are not needed: the scheduler releases a request
        only after sending its last save."""
        self._reap_saves()
        waiting = {t.req_id for t in self._bound.saves} if self._bound is not None else set()
        done = {r for r in self._released if r not in waiting and not self._dumping.get(r)}
        self._released -= done
        return done

    def build_worker_meta(self) -> UcmWorkerMetadata | None:
        if not self._dumped and not self._dump_failed and not self._loaded_steps:
            return None
        meta = UcmWorkerMetadata(
            dumped=dict(self._dumped),
            failed=set(self._dump_failed),
            loaded_steps=set(self._loaded_steps),
        )
        self._dumped = Counter()
        self._dump_failed = set()
        self._loaded_steps = set()
        return meta

    def load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid
