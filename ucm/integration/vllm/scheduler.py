"""The scheduler side of the connector: which blocks a request is served from UCM, the loads
planned into the vLLM blocks just allocated, the saves of each step, and the view of what is in
the store or being dumped into it. No engine needed: it works on vLLM's request and scheduler
output objects and asks the store through one ``lookup`` function."""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ... import namespaces
from ...breaker import DaemonPool
from ..claims import ComputeClaims
from ..keys import KeySpace, chain_block_ids, provisional_salt
from ..salts import lora_identity
from ..tenants import TenantMapping
from .metadata import BlockTransfer, UcmConnectorMetadata, UcmWorkerMetadata
from .metrics import UcmConnectorStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.ucm")

SALTS_KEPT = 4096
"""Distinct (cache_salt, LoRA) salts the scheduler memoises."""

Lookup = Callable[[Sequence[bytes]], Sequence[bool]]
"""The store's presence check (``Store.lookup``)."""
LookupPrefix = Callable[[Sequence[bytes]], int]
"""The store's prefix look-up (``Store.lookup_on_prefix``): index of the last block of the
longest present prefix, -1 if none; stops at the first missing block."""
SAVE_LOOKUPS_RUNNING_MAX = 1
"""Save filters left running on the look-up pool (a slow tier) before the next ones are
skipped (their blocks dumped without asking): the pool is kept for prefix look-ups."""
BlockTable = Callable[[Any, str], "list[int] | None"]
"""A request's vLLM block ids (the first KV cache group), from the step's block state."""
Release = Callable[[], None]
Hold = Callable[[Sequence[bytes]], "Release | None"]
"""Holds every shard of the blocks in the CacheBuffer against eviction, returning the release;
None (nothing held) when one is not there (``UcmConnector._hold``)."""


@dataclass
class _PendingLoad:
    """A load the workers ran (or will run) in step ``step`` whose outcome the scheduler has
    not seen yet."""

    step: int
    first_block: int
    vllm_blocks: list[int]
    load_async: bool = False
    """An asynchronous load: settled when vLLM reports the request in finished_recving (every
    rank done), not with its step's output."""
    invalid: set[int] = field(default_factory=set)
    """Its blocks that some rank reported failed so far (an asynchronous load)."""
    ucm_ids: list[bytes] = field(default_factory=list, repr=False)
    """The UCM ids it loads (a load of the request's own; empty for one of ``source``)."""
    release: Release | None = field(default=None, repr=False, compare=False)
    """Releases the CacheBuffer hold of a synchronous load's blocks (taken at look-up): they
    stay until the load's outcome is known."""
    source: _PendingLoad | None = field(default=None, repr=False, compare=False)
    """Set on a load of *another* request (``source``) whose vLLM blocks this request
    shares through vLLM's prefix cache and computed over: ``vllm_blocks`` are this request's
    blocks from ``first_block`` on. If that load fails, this request's blocks from the first
    failed one on are never saved (:attr:`_RequestState.save_cap`)."""


@dataclass
class _PendingLookup:
    """A request's prefix look-up still running on the look-up pool: the scheduler answers
    ``None`` ("ask again") until it is done, and never waits for it."""

    start: int
    """The request's block index the look-up starts at."""
    count: int
    """Blocks asked (from ``start``)."""
    skip: int
    """Leading blocks asked that were being dumped, so not looked up: the look-up asked the
    store about blocks ``[start + skip, start + count)``."""
    future: concurrent.futures.Future[int]


@dataclass
class _RequestState:
    """The scheduler's bookkeeping of one request."""

    request: Request
    salt: bytes
    namespace: str = namespaces.DEFAULT_NAMESPACE
    chain: list[bytes] = field(default_factory=list)
    """The hash chain of the request's full blocks so far (grows as blocks fill)."""
    ids: list[bytes] = field(default_factory=list)
    """UCM ids of those blocks: the chain scoped to the request's namespace."""
    saved: int = 0
    """Blocks [0, saved) are in UCM, being dumped, or were in vLLM's cache before the request:
    never dumped again by this request."""
    planned: tuple[int, int, bool] | None = None
    """(first block, tokens, asynchronous) of the last answer of get_num_new_matched_tokens."""
    hold: Release | None = None
    """The CacheBuffer hold of the planned synchronous load's blocks, until vLLM allocates
    (or asks again)."""
    load_cap: int | None = None
    """Blocks from this index on failed to load for this request: never served to it again
    (vLLM looks a request up again after an asynchronous load that failed at its first
    block; serving the same blocks again could fail again, forever)."""
    pending: list[_PendingLoad] = field(default_factory=list)
    """Loads whose outcome is unknown: no block from the first one's first block on is saved
    until they are known to have held (a failed load leaves garbage that every later block of
    the request attended to)."""
    dumping: bool = False
    """A dump of this request's blocks was sent to the workers: vLLM keeps its blocks, when it
    finishes, until the workers report it in get_finished."""
    claimed: set[bytes] = field(default_factory=set)
    """Blocks this request claimed (:class:`ComputeClaims`) because it computes them."""
    waiting_since: float | None = None
    """When it began to wait for another engine's compute of its first missing block."""
    save_cap: int | None = None
    """Blocks from this index on were computed over another request's load that failed (a
    vLLM block shared through vLLM's prefix cache): never saved by this request. vLLM does
    not always recompute them."""

    def barrier(self) -> int | None:
        return min((load.first_block for load in self.pending), default=None)


@dataclass
class _Finishing:
    """A finished request with loads still unconfirmed: its last saves and its release wait
    for their outcome."""

    state: _RequestState
    block_ids: list[int]
    ready: int


class SchedulerSide:
    """The connector's scheduler-role state machine (see the package docstring)."""

    def __init__(
        self,
        *,
        lookup: Lookup,
        key_space: KeySpace,
        lookup_prefix: LookupPrefix | None = None,
        block_tokens: int,
        shards_per_block: int,
        block_table: BlockTable,
        consumer: bool = True,
        producer: bool = True,
        report_ids: bool = False,
        stats: UcmConnectorStats | None = None,
        epoch: int | None = 0,
        tenants: TenantMapping | None = None,
        hold: Hold | None = None,
        every_load_async: bool = False,
        lookup_pool: DaemonPool | None = None,
        lookup_wait_s: float = 0.0,
        claims: ComputeClaims | None = None,
        compute_wait_s: float = 0.0,
    ) -> None:
        self._lookup = lookup
        self._lookup_prefix: LookupPrefix = lookup_prefix or (
            lambda ids: _prefix_of(self._lookup(ids))
        )
        self._tenants = tenants if tenants is not None else TenantMapping()
        self._new_namespaces: set[str] = set()
        """Namespaces not yet announced to the workers (UcmConnectorMetadata.namespaces)."""
        self._announced: set[str] = set()
        self._hold = hold
        """Holds blocks in the CacheBuffer (every shard): a load of blocks that all are is one
        memcpy and runs before the forward pass, held from the look-up until its outcome is
        known, so that no eviction between the look-up and the load fails it; any other load
        is asynchronous. None: ``every_load_async`` says."""
        self._every_load_async = every_load_async
        """Without ``hold``: every load is asynchronous (True) or runs before the forward
        pass (False)."""
        self._load_holds: dict[str, Release] = {}
        """Holds of the synchronous loads planned for this step."""
        self._lookup_pool = lookup_pool
        """Runs look-ups that may reach a lower tier (None: they run on the scheduler thread)."""
        self._lookup_wait_s = lookup_wait_s
        """How long the scheduler waits for a look-up on the pool before it answers ``None``
        (vLLM asks again on a later step) and lets the other requests run."""
        self._claims = claims
        """Blocks engines on this node are computing (None: no CacheBuffer, or turned off)."""
        self._compute_wait_s = compute_wait_s
        """How long a request waits for another engine's compute of its first missing block
        (``ucm_compute_wait_ms``) before it computes the block itself."""
        self._lookups: dict[str, _PendingLookup] = {}
        self._save_lookups: list[concurrent.futures.Future[Sequence[bool]]] = []
        """Save filters that outran ``lookup_wait_s`` and still run on the pool."""
        self.epoch = epoch
        """The key space's reset epoch (:class:`~ucm.integration.keys.Epochs`): every salt
        carries it. None while it is unknown (:class:`~ucm.integration.keys.EpochState`):
        salts then carry :attr:`_nonce` instead."""
        self._nonce = os.urandom(32)
        self._key_space = key_space
        self._block_tokens = block_tokens
        self._shards_per_block = shards_per_block
        self._block_table = block_table
        self._consumer = consumer
        self._producer = producer
        self._report_ids = report_ids
        self.stats = stats if stats is not None else UcmConnectorStats()
        self._salts: dict[tuple[str | None, str | None], bytes] = {}
        self._requests: dict[str, _RequestState] = {}
        self._loads: dict[str, BlockTransfer] = {}
        self._load_first: dict[str, int] = {}
        """Per planned load, the request's block index of its first block."""
        self._load_async: set[str] = set()
        """Requests whose planned load is asynchronous (WAITING_FOR_REMOTE_KVS)."""
        self._final_saves: list[BlockTransfer] = []
        self._finishing: dict[str, _Finishing] = {}
        self._release: set[str] = set()
        """Finished requests to release to the workers with the next step."""
        self._step = 0
        self._dumping_ids: dict[bytes, int] = {}
        """Blocks the workers were asked to dump → ranks not done yet: present for lookups."""

    def on_new_request(self, request: Request) -> None:
        self._state(request)

    def _state(self, request: Request) -> _RequestState | None:
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        embeds = getattr(request, "prompt_embeds", None)
        if getattr(request, "mm_features", None) or embeds is not None:
            return None  # token ids alone do not name this KV: never cached
        lora = lora_identity(getattr(request, "lora_request", None))
        cache_salt = getattr(request, "cache_salt", None)
        salt = self._salts.get((cache_salt, lora))
        if salt is None:
            space = self._key_space
            if lora is not None:
                space = replace(space, extra=(*space.extra, ("lora", lora)))
            if self.epoch is None:
                salt = provisional_salt(space.salt(cache_salt), self._nonce)
            else:
                salt = space.salt(cache_salt, self.epoch)
            if len(self._salts) >= SALTS_KEPT:  # per-user salts: keep the memo bounded
                self._salts.clear()
            self._salts[(cache_salt, lora)] = salt
        lora_request = getattr(request, "lora_request", None)
        namespace = self._tenants.namespace(
            cache_salt, getattr(lora_request, "lora_name", None) if lora_request else None
        )
        if namespace not in self._announced:
            self._announced.add(namespace)
            self._new_namespaces.add(namespace)
        state = _RequestState(request=request, salt=salt, namespace=namespace)
        if self.epoch is None:
            self.stats.data["requests_epoch_unknown"] += 1
        self._requests[request.request_id] = state
        return state

    def reset(self, epoch: int | None) -> None:
        """Moves the key space to ``epoch`` (None: unknown, a new nonce): every id computed
        from now on differs from every id saved before. Requests already tracked (running,
        waiting, or finishing with loads unconfirmed) get a throwaway salt of their own, so
        what they computed before the reset is neither served nor saved under the new epoch."""
        self.epoch = epoch
        self._nonce = os.urandom(32)
        if self._claims is not None:  # claims name the old epoch's ids
            self._claims.release(self._claims.held)
        self._salts.clear()
        self._lookups.clear()  # they asked about the old epoch's ids
        for state in [*self._requests.values(), *(f.state for f in self._finishing.values())]:
            state.salt = os.urandom(32)
            state.chain = []
            state.ids = []

    def _chain(self, state: _RequestState, blocks: int) -> list[bytes]:
        """The ids of the request's first ``blocks`` full blocks (extending the chain)."""
        have = len(state.ids)
        if blocks > have:
            bs = self._block_tokens
            tokens = list(state.request.all_token_ids[: blocks * bs])
            parent = state.chain[-1] if have else None
            chain = chain_block_ids(state.salt, tokens, bs, parent=parent, start_block=have)
            state.chain.extend(chain)
            state.ids.extend(namespaces.scope(state.namespace, chain))
        return state.ids[:blocks]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self._consumer or getattr(request, "skip_reading_prefix_cache", False):
            # prompt_logprobs (and other requests that must compute every token): no lookup,
            # no load planned, whatever the vLLM version does with the answer.
            return 0, False
        state = self._state(request)
        if state is None:
            return 0, False
        state.planned = None
        self._drop(state.hold)
        state.hold = None
        bs = self._block_tokens
        start = num_computed_tokens // bs
        full = int(request.num_tokens) // bs
        ids = self._chain(state, full)
        if full <= start:
            return 0, False
        try:
            matched = self._matched(request.request_id, ids[start:], start)
        except Exception as exc:  # a lookup never fails a request: it is a miss
            self.stats.data["lookup_errors"] += 1
            logger.warning("UCM lookup failed (served as a miss): %s", exc)
            return 0, False
        if matched is None:
            return None, False  # still looking: vLLM skips the request this step
        if self._waits_for_compute(state, ids, start + matched):
            return None, False  # another engine computes it: vLLM asks again next step
        found = matched
        if state.load_cap is not None:
            found = min(found, max(state.load_cap - start, 0))
        # vLLM must compute at least one token: never claim the whole prompt.
        hit = min((start + found) * bs, int(request.num_tokens) - 1)
        external = hit - num_computed_tokens
        if external <= 0:
            return 0, False
        load_async = self._loads_async(state, ids[start : math.ceil(hit / bs)])
        state.planned = (start, external, load_async)
        return external, load_async

    def _waits_for_compute(self, state: _RequestState, ids: Sequence[bytes], missing: int) -> bool:
        """Whether the request waits, this step, for another engine on the node that is
        computing its first missing block (``ids[missing]``): until that engine has saved it,
        and at most ``compute_wait_s`` in all, after which the request computes it itself."""
        claims = self._claims
        if claims is None or missing >= len(ids) or self._compute_wait_s <= 0:
            return False
        now = time.monotonic()
        if state.waiting_since is not None and now - state.waiting_since >= self._compute_wait_s:
            return False  # waited its fill: computes from here on
        if not claims.claimed_elsewhere(ids[missing]):
            return False
        if state.waiting_since is None:
            state.waiting_since = now
            self.stats.data["compute_waits"] += 1
        return True

    def _claim(self, state: _RequestState, first: int) -> None:
        """Claims the prompt's blocks from ``first`` on, which this request computes and saves."""
        if self._claims is None or not self._producer:
            return
        full = int(state.request.num_prompt_tokens) // self._block_tokens
        if first >= full:
            return
        state.claimed.update(self._claims.claim(self._chain(state, full)[first:]))

    def _unclaim(self, block_ids: Sequence[bytes]) -> None:
        """The blocks are in the store (or will not be saved): other engines need not wait."""
        if self._claims is not None and block_ids:
            self._claims.release(block_ids)

    def _loads_async(self, state: _RequestState, ids: Sequence[bytes]) -> bool:
        """Whether a load of these blocks runs asynchronously: unless all are in the
        CacheBuffer (a failed check counts as not), where they are held for the synchronous
        load (``state.hold``), so that no eviction fails it and vLLM need not recompute them.
        Without ``hold``, ``every_load_async`` says: the connector sets it under vLLM's
        asynchronous scheduling, where a synchronous load that failed costs a wrong token
        (vLLM keeps what the next step, scheduled before the failure is known, decoded over
        the failed block) and may leave vLLM never scheduling the request again."""
        if self._hold is None:
            return self._every_load_async
        try:
            release = self._hold(ids)
        except Exception as exc:
            logger.warning("UCM CacheBuffer hold failed (loading asynchronously): %s", exc)
            return True
        state.hold = release
        return release is None

    @staticmethod
    def _drop(release: Release | None) -> None:
        """Releases a CacheBuffer hold (a failed release is logged: the process's holds go
        with it at exit)."""
        if release is None:
            return
        try:
            release()
        except Exception as exc:
            logger.warning("UCM CacheBuffer hold not released: %s", exc)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        self._loads.pop(request.request_id, None)
        self._load_first.pop(request.request_id, None)
        self._load_async.discard(request.request_id)
        self._drop(self._load_holds.pop(request.request_id, None))
        planned, state.planned = state.planned, None
        hold, state.hold = state.hold, None
        if num_external_tokens <= 0 or planned is None or planned[2]:
            self._drop(hold)
        elif hold is not None:
            self._load_holds[request.request_id] = hold
        if num_external_tokens <= 0 or planned is None:
            computed = int(request.num_computed_tokens) + max(num_external_tokens, 0)
            self._claim(state, max(state.saved, computed // self._block_tokens))
            return
        start = planned[0]
        bs = self._block_tokens
        end = math.ceil((start * bs + num_external_tokens) / bs)
        table = list(blocks.get_block_ids()[0])
        ids = self._chain(state, end)
        self._loads[request.request_id] = BlockTransfer(
            req_id=request.request_id,
            vllm_blocks=table[start:end],
            ucm_ids=ids[start:end],
        )
        self._load_first[request.request_id] = start
        if planned[2]:
            self._load_async.add(request.request_id)
        state.saved = max(state.saved, end)
        self._claim(state, state.saved)
        self.stats.data["hit_tokens"] += num_external_tokens
        self.stats.data["hit_blocks"] += end - start

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UcmConnectorMetadata:
        self._step += 1
        step = self._step
        meta = UcmConnectorMetadata(
            loads=[t for r, t in self._loads.items() if r not in self._load_async],
            async_loads=[t for r, t in self._loads.items() if r in self._load_async],
            preempted=set(scheduler_output.preempted_req_ids or ()),
            step=step,
            namespaces=self._new_namespaces,
        )
        self._new_namespaces = set()
        for transfer in self._loads.values():
            state = self._requests.get(transfer.req_id)
            release = self._load_holds.pop(transfer.req_id, None)
            if state is None:
                self._drop(release)
                continue
            first = self._load_first[transfer.req_id]
            load_async = transfer.req_id in self._load_async
            state.pending.append(
                _PendingLoad(
                    step,
                    first,
                    list(transfer.vllm_blocks),
                    load_async,
                    ucm_ids=list(transfer.ucm_ids),
                    release=release,
                )
            )
        for release in self._load_holds.values():
            self._drop(release)
        self._load_holds.clear()
        self._loads.clear()
        self._load_first.clear()
        self._load_async.clear()
        computed_before: dict[str, int] = {
            new.req_id: int(new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs
        }
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed_before[req_id] = int(cached.num_computed_tokens[i])
        candidates: list[tuple[_RequestState, BlockTransfer]] = []
        if self._producer:
            bs = self._block_tokens
            block_state = getattr(scheduler_output, "kv_connector_block_state", None)
            unconfirmed = self._unconfirmed_blocks()
            for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
                state = self._requests.get(req_id)
                if state is None:
                    continue
                before = computed_before.get(req_id, int(state.request.num_computed_tokens))
                if math.ceil(before / bs) < state.saved:
                    # vLLM went back (a block failed to load, or the request was preempted):
                    # what it recomputes from here on is saved again.
                    state.saved = before // bs
                # A block is saved in the step that computes it (its dump runs after this
                # step's forward pass), once its tokens are known, and only while no load
                # beneath it is unconfirmed, its own or another request's.
                ready = min(before + int(scheduled), int(state.request.num_tokens)) // bs
                if unconfirmed and ready > state.saved:
                    self._depend(state, self._block_table(block_state, req_id), ready, unconfirmed)
                barrier = state.barrier()
                if barrier is not None:
                    ready = min(ready, barrier)
                if state.save_cap is not None:
                    ready = min(ready, state.save_cap)
                if ready <= state.saved:
                    continue
                table = self._block_table(block_state, req_id)
                if table is None or len(table) < ready:
                    continue
                ids = self._chain(state, ready)
                candidates.append(
                    (
                        state,
                        BlockTransfer(req_id, table[state.saved : ready], ids[state.saved : ready]),
                    )
                )
                state.saved = ready
        meta.saves = self._absent_only(candidates) + self._final_saves
        self._final_saves = []
        meta.released, self._release = self._release, set()
        return meta

    def _unconfirmed_blocks(self) -> dict[int, _PendingLoad]:
        """The vLLM blocks that synchronous loads not confirmed yet write into. vLLM's prefix
        cache shares them with requests scheduled in the load's step at once (synchronous
        loads run under synchronous scheduling only); an asynchronous load's blocks are shared
        only once its outcome is known."""
        states = [*self._requests.values(), *(f.state for f in self._finishing.values())]
        return {
            block: load
            for state in states
            for load in state.pending
            if not load.load_async and load.source is None
            for block in load.vllm_blocks
        }

    def _depend(
        self,
        state: _RequestState,
        table: list[int] | None,
        ready: int,
        unconfirmed: dict[int, _PendingLoad],
    ) -> None:
        """Makes the request's saves wait for each unconfirmed load of another request whose
        vLLM blocks are among its first ``ready`` blocks (shared through vLLM's prefix cache):
        every block of the request from the first shared one on was computed over it."""
        if not table or unconfirmed.keys().isdisjoint(table[:ready]):
            return
        known = {id(load) for load in state.pending}
        known |= {id(load.source) for load in state.pending if load.source is not None}
        for index, vllm_block in enumerate(table[:ready]):
            load = unconfirmed.get(vllm_block)
            if load is None or id(load) in known:
                continue
            known.add(id(load))
            state.pending.append(
                _PendingLoad(load.step, index, list(table[index:ready]), source=load)
            )

    def _matched(self, request_id: str, ids: Sequence[bytes], start: int) -> int | None:
        """How many of ``ids`` (the request's blocks from ``start`` on) are in the store or
        being dumped into it, from the first; ``None`` while the look-up is still running.

        Without a look-up pool (a stack whose only tier is the CacheBuffer: nothing to wait
        for) the look-up runs here. With one, it runs on the pool and the scheduler waits at
        most ``lookup_wait_s`` for it: a look-up that a slow or black-holed tier holds up (each
        tier's answer is bounded by its ``lookup_timeout_ms`` and breaker) answers ``None``, and
        vLLM asks again on later steps while the running requests keep decoding.
        """
        pending = self._lookups.pop(request_id, None)
        if pending is not None and (pending.start, pending.count) == (start, len(ids)):
            if not pending.future.done():
                self._lookups[request_id] = pending
                return None
            return self._present_prefix(ids, pending.skip, pending.future.result())
        skip = 0
        while skip < len(ids) and ids[skip] in self._dumping_ids:
            skip += 1
        if skip == len(ids):
            self.stats.data["lookups"] += 1
            return skip
        if self._lookup_pool is None:
            self.stats.data["lookups"] += 1
            return self._present_prefix(ids, skip, self._lookup_prefix(ids[skip:]))
        rest = list(ids[skip:])
        future = self._lookup_pool.try_submit(lambda: self._lookup_prefix(rest))
        if future is None:  # every pool thread is held by a slow tier: ask on a later step
            self.stats.data["lookups_deferred"] += 1
            return None
        self.stats.data["lookups"] += 1
        try:
            last = future.result(timeout=self._lookup_wait_s)
        except concurrent.futures.TimeoutError:
            self.stats.data["lookups_deferred"] += 1
            self._lookups[request_id] = _PendingLookup(start, len(ids), skip, future)
            return None
        return self._present_prefix(ids, skip, last)

    def _present_prefix(self, ids: Sequence[bytes], skip: int, last: int) -> int:
        """How many of ``ids``, from the first, are in the store or being dumped into it, given
        that ``ids[:skip]`` are being dumped and the store's prefix look-up of ``ids[skip:]``
        answered ``last`` (index of its last present block, -1 if none): then one more look-up
        past each block being dumped right now (rare: on this thread, each bounded by the
        tiers' deadlines and breakers)."""
        found = skip + last + 1
        for _ in range(len(ids) + 1):  # each round moves past at least one block
            if found == len(ids) or ids[found] not in self._dumping_ids:
                break
            while found < len(ids) and ids[found] in self._dumping_ids:
                found += 1
            if found == len(ids):
                break
            found += self._lookup_prefix(ids[found:]) + 1
        return found

    def _present(self, ids: Sequence[bytes]) -> list[bool]:
        """Whether each block is in the store or being dumped into it right now. With a look-up
        pool the scheduler waits at most ``lookup_wait_s`` for the store's answer; past it the
        blocks count as absent (the step dumps them all: a dump of a block already stored
        rewrites the same bytes, it never serves a wrong one)."""
        asked = [block_id for block_id in ids if block_id not in self._dumping_ids]
        found: Sequence[bool] = [False] * len(asked)
        pool = self._lookup_pool
        if asked and pool is None:
            found = self._lookup(asked)
        elif asked and pool is not None:
            # Save filters still running on the pool (a slow tier) are not joined by more:
            # the pool stays free for the prefix look-ups that admit requests.
            self._save_lookups = [future for future in self._save_lookups if not future.done()]
            future = (
                pool.try_submit(lambda: self._lookup(asked))
                if len(self._save_lookups) < SAVE_LOOKUPS_RUNNING_MAX
                else None
            )
            if future is None:
                self.stats.data["save_lookups_skipped"] += 1
            else:
                try:
                    found = future.result(timeout=self._lookup_wait_s)
                except concurrent.futures.TimeoutError:
                    self._save_lookups.append(future)
                    self.stats.data["save_lookups_skipped"] += 1
        answers = dict(zip(asked, found, strict=True))
        return [block_id in self._dumping_ids or answers[block_id] for block_id in ids]

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        recving = set(getattr(connector_output, "finished_recving", None) or ())
        if invalid or recving:
            self._settle_async(recving, invalid)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, UcmWorkerMetadata):
            return
        done: list[bytes] = []
        for block_id, ranks in meta.dumped.items():
            left = self._dumping_ids.get(block_id, 0) - ranks
            if left > 0:
                self._dumping_ids[block_id] = left
            else:
                self._dumping_ids.pop(block_id, None)
                done.append(block_id)
        for block_id in meta.failed:  # not whole in the store: ask the store from now on
            self._dumping_ids.pop(block_id, None)
            done.append(block_id)
        self._unclaim(done)
        if meta.loaded_steps:
            self._settle_loads(meta.loaded_steps, invalid)

    def _settle_async(self, recving: set[str], invalid: set[int]) -> None:
        """Asynchronous loads collect the blocks each rank reports failed; those of the
        requests in ``recving`` are done (every rank reported them)."""
        done: set[int] = set()
        for req_id, state in self._requests.items():
            for load in state.pending:
                if load.load_async:
                    load.invalid |= invalid.intersection(load.vllm_blocks)
                    if req_id in recving:
                        done.add(id(load))
        if done:
            self._settle(lambda load: id(load) in done, set())

    def _settle_loads(self, steps: set[int], invalid: set[int]) -> None:
        """The loads of ``steps`` are done: those that hit an invalid block failed from that
        block on (vLLM recomputes it and every block after it); the others held."""
        self._settle(lambda load: not load.load_async and load.step in steps, invalid)

    def _settle(self, done: Callable[[_PendingLoad], bool], invalid: set[int]) -> None:
        by_state = {id(f.state): f for f in self._finishing.values()}
        for state in [*self._requests.values(), *(f.state for f in self._finishing.values())]:
            settled = [load for load in state.pending if done(load)]
            if not settled:
                continue
            state.pending = [load for load in state.pending if not done(load)]
            for load in settled:
                self._drop(load.release)
                load.release = None
                bad = [
                    i
                    for i, block in enumerate(load.vllm_blocks)
                    if block in invalid or block in load.invalid
                ]
                if bad and load.source is not None:
                    # Another request's load this one computed over: vLLM may keep what this
                    # one computed over the failed block; nothing from it on is saved.
                    failed = load.first_block + bad[0]
                    state.save_cap = (
                        failed if state.save_cap is None else min(state.save_cap, failed)
                    )
                    if id(state) in by_state:
                        by_state[id(state)].ready = min(by_state[id(state)].ready, failed)
                elif bad:
                    failed = load.first_block + bad[0]
                    state.load_cap = (
                        failed if state.load_cap is None else min(state.load_cap, failed)
                    )
                    # Running: vLLM recomputes from the failed block on, and saves follow.
                    # Finished: nothing recomputes it; no block from it on is ever saved.
                    state.saved = min(state.saved, failed)
                    if id(state) in by_state:
                        by_state[id(state)].ready = min(by_state[id(state)].ready, failed)
        for req_id, finishing in list(self._finishing.items()):
            if not finishing.state.pending:
                del self._finishing[req_id]
                self._finish(
                    req_id, finishing.state, finishing.block_ids, finishing.ready, held=True
                )

    def _absent_only(
        self, candidates: Sequence[tuple[_RequestState, BlockTransfer]]
    ) -> list[BlockTransfer]:
        """The transfers without the blocks the store already holds; marks the requests whose
        blocks the workers will dump."""
        if not candidates:
            return []
        every = list(
            dict.fromkeys(block_id for _, transfer in candidates for block_id in transfer.ucm_ids)
        )
        try:
            present = dict(zip(every, self._present(every), strict=True))
        except Exception as exc:
            self.stats.data["lookup_errors"] += 1
            logger.warning("UCM lookup before saving failed (saving every block): %s", exc)
            present = {}
        # Already in the store: nobody needs to wait for this engine's compute of them.
        self._unclaim([block_id for block_id, hit in present.items() if hit])
        kept: list[BlockTransfer] = []
        for state, transfer in candidates:
            pairs = [
                (vllm_block, block_id)
                for vllm_block, block_id in zip(transfer.vllm_blocks, transfer.ucm_ids, strict=True)
                if not present.get(block_id, False)
            ]
            if pairs:
                kept.append(
                    BlockTransfer(transfer.req_id, [p[0] for p in pairs], [p[1] for p in pairs])
                )
                state.dumping = True
                for _, block_id in pairs:
                    present[block_id] = True  # a second request of this step does not dump it
                    self._dumping_ids[block_id] = (
                        self._dumping_ids.get(block_id, 0) + self._shards_per_block
                    )
        return kept

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        self._load_first.pop(request.request_id, None)
        self._load_async.discard(request.request_id)
        self._drop(self._load_holds.pop(request.request_id, None))
        if state is None:
            return False, None
        self._drop(state.hold)
        state.hold = None
        params = None
        if self._report_ids:
            full = int(request.num_computed_tokens) // self._block_tokens
            params = {"ucm_block_ids": [block_id.hex() for block_id in self._chain(state, full)]}
        ready = min(int(request.num_computed_tokens), int(request.num_tokens)) // self._block_tokens
        if any(load.load_async for load in state.pending):
            # Finished in WAITING_FOR_REMOTE_KVS (an abort): it computed nothing, and vLLM
            # keeps its blocks until the workers report its load in finished_recving.
            for load in state.pending:  # never settled: the state is dropped
                self._drop(load.release)
                load.release = None
            self._unclaim_finished(state)
            return False, params
        if state.pending:
            # Its last blocks were computed over loads not yet confirmed (an abort between
            # steps, or a request that finished in the step it loaded): vLLM keeps its blocks
            # until they are, then they are saved or dropped and the request released.
            self._finishing[request.request_id] = _Finishing(state, list(block_ids), ready)
            return True, params
        return self._finish(request.request_id, state, list(block_ids), ready), params

    def _finish(
        self,
        req_id: str,
        state: _RequestState,
        block_ids: list[int],
        ready: int,
        held: bool = False,
    ) -> bool:
        """Sends a finished request's last saves; whether vLLM must keep its blocks until the
        workers report it (then it is released to them with the next step)."""
        if state.save_cap is not None:
            ready = min(ready, state.save_cap)
        if self._producer and ready > state.saved and len(block_ids) >= ready:
            ids = self._chain(state, ready)
            transfer = BlockTransfer(
                req_id, block_ids[state.saved : ready], ids[state.saved : ready]
            )
            self._final_saves.extend(self._absent_only([(state, transfer)]))
            state.saved = ready
        if state.dumping or held:  # held: vLLM was already told to keep the blocks
            self._release.add(req_id)
        self._unclaim_finished(state)
        return state.dumping

    def _unclaim_finished(self, state: _RequestState) -> None:
        """A finished request's claims end, but those of blocks still being dumped, which end
        with their dumps."""
        self._unclaim([block_id for block_id in state.claimed if block_id not in self._dumping_ids])
        state.claimed.clear()


def _prefix_of(present: Sequence[bool]) -> int:
    """``lookup_on_prefix``'s answer from a full look-up's."""
    return next((i for i, hit in enumerate(present) if not hit), len(present)) - 1
