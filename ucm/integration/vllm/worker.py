"""The worker side of the connector (one per TP rank): loads into vLLM's KV cache tensors
before the forward pass, dumps after it, and which requests' blocks vLLM may free. No engine
needed: it works on a store and one block-contiguous tensor view per layer."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ucm.errors import TaskError

from .metadata import BlockTransfer, UcmConnectorMetadata, UcmWorkerMetadata
from .metrics import UcmConnectorStats

if TYPE_CHECKING:
    import torch

    from ucm.store import Store
    from ucm.task import Task

logger = logging.getLogger("vllm.ucm")


@dataclass(eq=False)
class _PendingSave:
    task: Task
    requests: set[str]
    ids: list[bytes]
    finished: bool = False


def _unique_key_groups(loads: Iterable[BlockTransfer]) -> list[list[tuple[bytes, int]]]:
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
    ) -> None:
        self._store = store
        self._rank = rank
        self._shard_size = shard_size
        self.stats = stats if stats is not None else UcmConnectorStats()
        self._block_views: list[torch.Tensor] = []
        self._invalid: set[int] = set()
        self._saves: list[_PendingSave] = []
        self._dumping: Counter[str] = Counter()
        """Per request, dump tasks in flight."""
        self._save_requests: set[str] = set()
        """Requests the scheduler sent dumps for: each is reported once in get_finished."""
        self._finishing: set[str] = set()
        self._dumped: Counter[bytes] = Counter()
        self._dump_failed: set[bytes] = set()
        """Dumps finished since the last step's worker metadata (see UcmWorkerMetadata)."""

    def set_block_views(self, views: list[torch.Tensor]) -> None:
        """One tensor per stored layer, ``view[b]`` = vLLM block b of that layer, contiguous."""
        self._block_views = views

    def _block_tensors(self, vllm_block: int) -> list[torch.Tensor]:
        return [view[vllm_block] for view in self._block_views]

    def handle_preemptions(self, meta: UcmConnectorMetadata) -> None:
        preempted = meta.preempted
        if not preempted:
            return
        # Their blocks are free from this step on: every dump still reading them must finish
        # before the forward pass can write into them.
        for pending in list(self._saves):
            if pending.requests & preempted:
                self._finish_save(pending)
        self._saves = [pending for pending in self._saves if not pending.finished]

    def start_load(self, meta: UcmConnectorMetadata) -> None:
        if not meta.loads:
            return
        started = time.perf_counter()
        wanted = {block_id for transfer in meta.loads for block_id in transfer.ucm_ids}
        for pending in self._saves:
            if not wanted.isdisjoint(pending.ids):  # a block this rank is still dumping
                self._finish_save(pending)
        submitted: list[tuple[Task | None, list[tuple[bytes, int]]]] = []
        for group in _unique_key_groups(meta.loads):
            ids = [block_id for block_id, _ in group]
            try:
                task = self._store.load(
                    ids,
                    [self._rank] * len(ids),
                    [self._block_tensors(vllm_block) for _, vllm_block in group],
                )
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

    def wait_for_save(self, meta: UcmConnectorMetadata | None) -> None:
        self._reap_saves()
        if meta is None or not meta.saves:
            return
        requests: set[str] = set()
        seen: set[bytes] = set()
        ids: list[bytes] = []
        sources: list[list[torch.Tensor]] = []
        for transfer in meta.saves:
            requests.add(transfer.req_id)
            for vllm_block, block_id in zip(transfer.vllm_blocks, transfer.ucm_ids, strict=True):
                if block_id in seen:  # two requests of one step filled the same block
                    continue
                seen.add(block_id)
                ids.append(block_id)
                sources.append(self._block_tensors(vllm_block))
        self._save_requests.update(requests)
        try:
            task = self._store.dump(ids, [self._rank] * len(ids), sources)
        except Exception as exc:
            logger.warning("UCM dump of %d blocks not submitted: %s", len(ids), exc)
            self.stats.data["save_failed_blocks"] += len(ids)
            self._dump_failed.update(ids)
            return
        self._saves.append(_PendingSave(task=task, requests=requests, ids=ids))
        self._dumping.update(requests)

    def _reap_saves(self) -> None:
        for pending in self._saves:
            if self._store.check(pending.task):
                self._finish_save(pending)
        self._saves = [pending for pending in self._saves if not pending.finished]

    def _finish_save(self, pending: _PendingSave) -> None:
        if pending.finished:
            return
        failed: set[bytes] = set()
        try:
            self._store.wait(pending.task)  # at once when reaped; blocks for a preemption
        except TaskError as exc:
            failed = {block_id for block_id, _shard in exc.failures}
            logger.warning(
                "UCM: %d of %d blocks failed to save: %s", len(failed), len(pending.ids), exc
            )
        except Exception as exc:
            failed = set(pending.ids)
            logger.warning("UCM: a dump of %d blocks failed: %s", len(pending.ids), exc)
        pending.finished = True
        saved = len(pending.ids) - len(failed)
        self.stats.data["saved_blocks"] += saved
        self.stats.data["saved_bytes"] += saved * self._shard_size
        self.stats.data["save_failed_blocks"] += len(failed)
        self._dumped.update(block_id for block_id in pending.ids if block_id not in failed)
        self._dump_failed |= failed
        self._dumping.subtract(pending.requests)
        for req_id in pending.requests:
            if self._dumping[req_id] <= 0:
                del self._dumping[req_id]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._reap_saves()
        self._finishing.update(finished_req_ids & self._save_requests)
        done = {req_id for req_id in self._finishing if not self._dumping.get(req_id)}
        self._finishing -= done
        self._save_requests -= done
        return (done or None), None

    def build_worker_meta(self) -> UcmWorkerMetadata | None:
        if not self._dumped and not self._dump_failed:
            return None
        meta = UcmWorkerMetadata(dumped=dict(self._dumped), failed=set(self._dump_failed))
        self._dumped = Counter()
        self._dump_failed = set()
        return meta

    def load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid
