"""``StagingSlots`` (``ucm.integration.bounded``): the vLLM worker's staged saves reuse shard
slots of one reservation, warm ones first, up to the reservation's size, and give the pages of
slots past the warm bound back to the system before those slots are free again."""

from __future__ import annotations

import ctypes

import pytest

from ucm.integration.bounded import StagingSlots
from ucm.layout import Layout

PAGE = 4096


def _layout(tensor_sizes: list[int]) -> Layout:
    return Layout(sum(tensor_sizes), 1, tuple(tensor_sizes))


def _write(slots: StagingSlots, slot: int, value: int) -> None:
    address = slots.addresses([slot])[0][0]
    ctypes.memset(address, value, slots.shard_size)


def _read(slots: StagingSlots, slot: int) -> bytes:
    address = slots.addresses([slot])[0][0]
    return ctypes.string_at(address, slots.shard_size)


def test_slots_give_each_tensors_address_inside_the_reservation() -> None:
    slots = StagingSlots(_layout([PAGE, 2 * PAGE]), capacity=4)
    assert slots.shard_size == 3 * PAGE
    base = slots.addresses([0])[0][0]
    assert slots.addresses([2, 0]) == [
        [base + 2 * 3 * PAGE, base + 2 * 3 * PAGE + PAGE],
        [base, base + PAGE],
    ]
    assert len(slots.memory) == 4 * 3 * PAGE


def test_a_take_past_the_free_slots_takes_nothing_and_given_slots_are_free_again() -> None:
    slots = StagingSlots(_layout([PAGE]), capacity=5)
    first = slots.take(3)
    assert first is not None and len(set(first)) == 3
    assert slots.take(3) is None  # 2 free: nothing taken
    assert (slots.free, slots.held, len(slots)) == (2, 3, 3 * PAGE)
    second = slots.take(2)
    assert second is not None and set(first).isdisjoint(second)
    assert slots.take(1) is None
    assert slots.give(first) == []  # under the warm bound: free at once
    assert (slots.free, slots.held, slots.high_water) == (3, 2, 5)
    with pytest.raises(ValueError, match="count=0: take at least one slot"):
        slots.take(0)
    with pytest.raises(ValueError, match="capacity=0: staging holds at least one slot"):
        StagingSlots(_layout([PAGE]), capacity=0)


def test_warm_slots_are_taken_first_and_keep_their_pages() -> None:
    slots = StagingSlots(_layout([PAGE]), capacity=8)
    taken = slots.take(2)
    assert taken is not None
    for slot in taken:
        _write(slots, slot, 0x5A)
    assert slots.give(taken) == []
    again = slots.take(2)
    assert again is not None and sorted(again) == sorted(taken)  # the warm ones
    assert all(_read(slots, slot) == b"\x5a" * PAGE for slot in again)


def test_slots_past_the_warm_bound_are_trimmed_before_they_are_free() -> None:
    """warm_bytes of 2 slots, but a take of 3 raises the bound to 3: of 5 given back, 3 stay
    warm and 2 are returned for trim, which zeroes their pages (given back to the system)
    and only then frees them."""
    slots = StagingSlots(_layout([PAGE]), capacity=6, warm_bytes=2 * PAGE)
    big = slots.take(3)
    small = slots.take(2)
    assert big is not None and small is not None
    for slot in big + small:
        _write(slots, slot, 0xC3)
    assert slots.give(big) == []
    cold = slots.give(small)
    assert sorted(cold) == sorted(small)
    assert slots.free == 4  # 1 never taken + 3 warm; the 2 to trim are not free yet
    assert all(_read(slots, slot) == b"\xc3" * PAGE for slot in cold)
    slots.trim(cold)
    assert slots.free == 6
    assert all(_read(slots, slot) == bytes(PAGE) for slot in cold)
    assert all(_read(slots, slot) == b"\xc3" * PAGE for slot in big)


def test_a_trim_never_touches_a_page_that_a_slot_outside_it_shares() -> None:
    """Slots of 1.5 pages: trimming slot 1 alone may give back no page that slot 0 or 2
    shares; trimming slots 1 and 2 gives back the pages wholly inside them."""
    shard = PAGE + PAGE // 2
    slots = StagingSlots(_layout([shard]), capacity=4, warm_bytes=shard)
    taken = slots.take(4)
    assert taken is not None
    for slot in taken:
        _write(slots, slot, 0x11 * (slot + 1))
    slots.trim([1])  # the page arithmetic alone: these slots are still taken
    assert _read(slots, 0) == bytes([0x11]) * shard
    assert _read(slots, 2) == bytes([0x33]) * shard
    slots.trim([3, 2])
    assert _read(slots, 0) == bytes([0x11]) * shard
    assert _read(slots, 1)[: PAGE // 2] == bytes([0x22]) * (PAGE // 2)  # its page shared with 0


RESERVE_UNDER_A_LIMIT = """
import logging, resource, sys
from ucm.integration.bounded import StagingSlots
from ucm.layout import Layout

logging.basicConfig(stream=sys.stderr, format="%(message)s")

mib = 1 << 20
with open("/proc/self/status") as status:
    vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + 384 * mib, resource.RLIM_INFINITY))
slots = StagingSlots.reserve(Layout(mib, 1, (mib,)), 4096, "shards", "some are skipped")
print(slots.capacity)  # 4 GiB asked
slots.take(slots.capacity)  # every slot of what was reserved can be handed out
"""


def test_a_reservation_the_system_refuses_halves_until_it_fits() -> None:
    """In a process whose address space is limited to 384 MiB more than it uses, 4 GiB of
    slots (4,096 of 1 MiB) are refused, and the reservation halves until it fits: 256 slots,
    with a warning that says so."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", RESERVE_UNDER_A_LIMIT],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["256"]
    warning = done.stderr.strip()
    assert warning.startswith("UCM: staging memory for 256 of the 4096 shards ([Errno 12] ")
    assert warning.endswith("): some are skipped")
