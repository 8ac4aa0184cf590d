"""The CUDA staging ring (``ucm.staging``): its slot bookkeeping and back-pressure on the CPU
(``SlotRing``, no CUDA needed), the registration chunking of the buffer's memory, and, where a
GPU exists, CUDA dumps and loads through the ring."""

from __future__ import annotations

import random
import threading
import uuid
from typing import Any

import pytest

from ucm.errors import TierError
from ucm.loadqueue import register_chunk_bytes
from ucm.staging import SlotRing, StagedTask, StagingFullError

JOIN_S = 60.0


def test_slots_are_distinct_lowest_first_and_reused() -> None:
    ring = SlotRing(5, wait_s=0.0)
    first = ring.acquire(3)
    assert first == [0, 1, 2] and ring.free == 2
    second = ring.acquire(2)
    assert second == [3, 4] and ring.free == 0
    ring.release([1, 0])
    assert ring.acquire(2) == [0, 1]  # the lowest (already pinned) slots first
    assert (ring.acquired, ring.released, ring.high_water) == (7, 2, 5)
    assert ring.acquire(0) == []


def test_a_task_larger_than_the_ring_fails_at_once_naming_both() -> None:
    ring = SlotRing(4, wait_s=30.0)
    with pytest.raises(
        StagingFullError, match="a task of 5 CUDA shards needs 5 staging slots but the ring has 4"
    ):
        ring.acquire(5)
    assert ring.waits == 0 and ring.free == 4


def test_a_full_ring_fails_after_its_bounded_wait() -> None:
    ring = SlotRing(2, wait_s=0.05)
    held = ring.acquire(2)
    with pytest.raises(
        StagingFullError,
        match=r"no 1 free CUDA staging slots within 0.05 s "
        r"\(0 of 2 free\)",
    ):
        ring.acquire(1)
    assert (ring.waits, ring.timeouts) == (1, 1)
    ring.release(held)
    assert ring.acquire(2) == [0, 1]  # nothing leaked by the failed acquire


def test_a_dump_does_not_wait_for_slots() -> None:
    """A dump passes wait_s=0: a full ring fails it at once, whatever the ring's own wait."""
    ring = SlotRing(2, wait_s=JOIN_S)
    ring.acquire(2)
    with pytest.raises(StagingFullError, match=r"within 0.0 s \(0 of 2 free\)"):
        ring.acquire(1, wait_s=0.0)
    assert (ring.waits, ring.timeouts) == (1, 1)


def test_a_waiting_task_takes_the_slots_a_completed_task_returns() -> None:
    """Back-pressure: the waiter blocks (it is counted as waiting) until another thread
    releases; then it gets exactly the released slots."""
    ring = SlotRing(3, wait_s=JOIN_S)
    held = ring.acquire(3)
    got: list[list[int]] = []
    waiter = threading.Thread(target=lambda: got.append(ring.acquire(2)))
    waiter.start()
    for _ in range(10_000):  # bounded: until the waiter is parked on the condition
        if ring.waits:
            break
        threading.Event().wait(0.001)
    assert ring.waits == 1 and got == []
    ring.release(held[:2])
    waiter.join(JOIN_S)
    assert not waiter.is_alive()
    assert got == [[0, 1]] and ring.timeouts == 0 and ring.free == 0


def test_a_slot_is_released_once() -> None:
    ring = SlotRing(2, wait_s=0.0)
    task = StagedTask(ring, ring.acquire(2))
    task.release()
    task.release()  # idempotent: completion and a failed submit may both get there
    assert ring.free == 2 and ring.released == 2
    with pytest.raises(ValueError, match="slot 0 is not held: released twice"):
        ring.release([0])


def test_concurrent_tasks_never_share_a_slot() -> None:
    ring = SlotRing(8, wait_s=JOIN_S)
    owners: dict[int, int] = {}
    lock = threading.Lock()
    errors: list[str] = []

    def worker(me: int) -> None:
        rng = random.Random(me)
        for _ in range(300):
            slots = ring.acquire(rng.randint(1, 5))
            with lock:
                for slot in slots:
                    if slot in owners:
                        errors.append(f"slot {slot} held by {owners[slot]} and {me}")
                    owners[slot] = me
            with lock:
                for slot in slots:
                    del owners[slot]
            ring.release(slots)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert ring.free == 8 and ring.acquired == ring.released and ring.high_water <= 8


@pytest.mark.parametrize(
    ("slot", "segment", "target", "chunk"),
    [
        (262144, 64 << 20, 16 << 20, 16 << 20),  # page and slot multiples: the target
        (3 * 4096, 12 << 20, 1 << 20, 85 * 3 * 4096),  # rounded down to whole slots
        (4104, 4104 * 256, 1 << 20, 4104 * 256),  # lcm(4104, 4096) > segment: all
        (4104, 4104 * 4096, 1 << 20, 4104 * 512),  # one lcm, above the target
        (4096, 1 << 20, 4 << 20, 1 << 20),  # a segment smaller than the target
    ],
)
def test_registration_chunks_hold_whole_slots_and_pages(
    slot: int, segment: int, target: int, chunk: int
) -> None:
    got = register_chunk_bytes(slot, segment, target)
    assert got == chunk
    assert got == segment or (got % slot == 0 and got % 4096 == 0)


torch: Any = pytest.importorskip("torch")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("registered", [True, False])
def test_cuda_dumps_and_loads_go_through_the_ring_without_a_device_sync(
    monkeypatch: pytest.MonkeyPatch, registered: bool
) -> None:
    import ucm
    from ucm import staging
    from ucm.native import segments

    size = 64 * 1024
    unique_id = f"staging-{uuid.uuid4().hex[:10]}"

    def no_device_sync(*_args: object) -> None:
        raise AssertionError("torch.cuda.synchronize() of the whole device")

    monkeypatch.setattr(torch.cuda, "synchronize", no_device_sync)
    stack = {
        "unique_id": unique_id,
        "tensor_size_list": [size // 2, size // 2],
        "shards_per_block": 1,
        "tiers": [{"type": "buffer", "capacity": 64 * size}],
    }
    try:
        with ucm.open(stack, device_id=0) as store:
            if not registered:
                store._native._cuda_checked = True  # the staging fallback for loads too
            ids = [bytes([i]) * 16 for i in range(1, 9)]
            src = [
                [
                    torch.randint(0, 255, (size // 2,), dtype=torch.uint8, device="cuda")
                    for _ in range(2)
                ]
                for _ in ids
            ]
            ring = staging.cuda_staging(size).ring
            store.wait(store.dump(ids, 0, src))
            assert ring.free == ring.capacity
            dst = [
                [torch.zeros(size // 2, dtype=torch.uint8, device="cuda") for _ in range(2)]
                for _ in ids
            ]
            store.wait(store.load(ids, 0, dst))
            for got, want in zip(dst, src, strict=True):
                assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            assert ring.free == ring.capacity
            too_many = [i.to_bytes(2, "big") * 8 for i in range(ring.capacity + 1)]
            with pytest.raises(StagingFullError, match="staging slots but the ring has"):
                store.dump(too_many, 0, [src[0]] * len(too_many))
            assert ring.free == ring.capacity
            held = ring.acquire(ring.capacity)
            with pytest.raises(StagingFullError, match=r"no 1 free CUDA staging slots within 0\.0"):
                store.dump([b"\xee" * 16], 0, [src[0]])  # a save never waits for slots
            ring.release(held)
    finally:
        segments.unlink(unique_id)


def test_a_batched_copy_passes_every_triple_in_calls_of_at_most_the_batch_size() -> None:
    """``BatchCopier`` over a stand-in for ``cudaMemcpyBatchAsync`` that copies host bytes (the
    same ABI: pointer arrays, a count, one attribute, a stream): every byte lands, in calls of
    at most ``BATCH_COPIES_MAX`` copies, on the stream given; a CUDA error is named."""
    import ctypes

    from ucm import cudart

    calls: list[tuple[int, int, int]] = []
    status = [0]

    signature = ctypes.CFUNCTYPE(
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_size_t,
        ctypes.c_void_p,
    )

    def stand_in(targets, sources, sizes, count, _attributes, indexes, attributes, stream):  # type: ignore[no-untyped-def]
        calls.append((count, attributes, stream or 0))
        assert indexes[0] == 0
        as_array = ctypes.POINTER(ctypes.c_uint64)
        targets, sources, sizes = (ctypes.cast(a, as_array) for a in (targets, sources, sizes))
        for i in range(count):
            ctypes.memmove(targets[i], sources[i], sizes[i])
        return status[0]

    function = signature(stand_in)
    copier = cudart.BatchCopier(function)
    n = cudart.BATCH_COPIES_MAX + 3
    sources = [(ctypes.c_ubyte * 16)(*bytes([i % 251]) * 16) for i in range(n)]
    targets = [(ctypes.c_ubyte * 16)() for _ in range(n)]
    copier.copy(
        [ctypes.addressof(t) for t in targets],
        [ctypes.addressof(s) for s in sources],
        [16] * n,
        stream=0xBEEF,
    )
    assert [bytes(t) for t in targets] == [bytes(s) for s in sources]
    assert calls == [(cudart.BATCH_COPIES_MAX, 1, 0xBEEF), (3, 1, 0xBEEF)]
    status[0] = 700
    with pytest.raises(
        TierError, match="cudaMemcpyBatchAsync of 1 copies failed with CUDA error 700"
    ):
        copier.copy([ctypes.addressof(targets[0])], [ctypes.addressof(sources[0])], [16], stream=0)
    with pytest.raises(ValueError, match="2 targets, 1 sources and 2 sizes"):
        copier.copy([1, 2], [3], [4, 5], stream=0)
    if not torch.cuda.is_available():
        assert cudart.batch_copier() is None  # no CUDA runtime in this process
