"""What the scheduler sends the workers each step, and what the workers send back."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class BlockTransfer:
    """One request's blocks to load or save in one step: vLLM block ids and UCM block ids."""

    req_id: str
    vllm_blocks: list[int]
    ucm_ids: list[bytes]


@dataclass
class UcmConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler asks every worker to do in one step."""

    loads: list[BlockTransfer] = field(default_factory=list)
    """Loads that finish before this step's forward pass (CacheBuffer hits: one memcpy)."""
    async_loads: list[BlockTransfer] = field(default_factory=list)
    """Loads of requests in WAITING_FOR_REMOTE_KVS: each worker moves the blocks up into the
    CacheBuffer (a prefetch), copies them into vLLM's blocks once there or once the load
    deadline passes, and reports the request in ``get_finished``'s finished_recving."""
    saves: list[BlockTransfer] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    """Requests preempted this step: their blocks are freed, so pending dumps must finish
    before this step's forward pass can overwrite them."""
    released: set[str] = field(default_factory=set)
    """Finished requests whose blocks vLLM keeps for UCM (``request_finished`` answered true):
    every save of theirs is in this step or an earlier one. A worker reports each in
    ``get_finished`` once, when every one of those saves has completed on it."""
    step: int = 0
    """The scheduler's number for this step: a worker that ran its loads echoes it
    (:attr:`UcmWorkerMetadata.loaded_steps`) with the output that carries their failures."""
    namespaces: set[str] = field(default_factory=set)
    """Namespaces the scheduler mapped requests to since its last step: each worker registers
    them (``ucm.namespaces.register``), so its tiers place those namespaces' keys under their
    prefixes (the ids in ``loads``/``saves`` are already scoped)."""


@dataclass
class UcmWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """What the workers tell the scheduler after a step: the dumps they finished, so that the
    scheduler counts a block as present from the moment it asks for its dump (a request right
    behind another with the same prefix gets a hit) until every rank is done with it."""

    dumped: dict[bytes, int] = field(default_factory=dict)
    """Block id → ranks that finished dumping their shard of it."""
    failed: set[bytes] = field(default_factory=set)
    """Blocks a rank failed to dump."""
    loaded_steps: set[int] = field(default_factory=set)
    """Steps whose loads this output reports: its ``invalid_block_ids`` hold every block of
    theirs that failed, so the scheduler knows which loads held."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> UcmWorkerMetadata:
        if isinstance(other, UcmWorkerMetadata):
            for block_id, ranks in other.dumped.items():
                self.dumped[block_id] = self.dumped.get(block_id, 0) + ranks
            self.failed |= other.failed
            self.loaded_steps |= other.loaded_steps
        return self
