"""RearrangeIndex (seed 000 §3.1, Scenario A): a pure permutation per rank, asked of the native
queue, which holds the one implementation (``walk_order`` in queue.zig)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ucm.errors import InvalidArgumentError
from ucm.native.queue import walk_order


def test_scenario_a_four_ranks_twelve_shards() -> None:
    orders = {rank: walk_order(12, rank, 4) for rank in range(4)}
    # Each rank sweeps its own stride first, then rotates to the next rank's stride.
    assert orders[0] == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]
    assert orders[1] == [1, 5, 9, 2, 6, 10, 3, 7, 11, 0, 4, 8]
    assert orders[2] == [2, 6, 10, 3, 7, 11, 0, 4, 8, 1, 5, 9]
    assert orders[3] == [3, 7, 11, 0, 4, 8, 1, 5, 9, 2, 6, 10]
    # Step 0: rank r asks for shard r (four different shards, four different bucket locks).
    assert [orders[rank][0] for rank in range(4)] == [0, 1, 2, 3]
    assert [orders[rank][1] for rank in range(4)] == [4, 5, 6, 7]
    # At every step the four ranks ask for four different shards ...
    for step in range(12):
        assert len({orders[rank][step] for rank in range(4)}) == 4, step
    # ... so after 3 steps every shard has exactly one owner: the task completes in 3 steps
    # of 4 concurrent loads instead of 12 serial ones.
    first_three = [set(orders[rank][:3]) for rank in range(4)]
    assert set().union(*first_three) == set(range(12))
    assert sum(len(owned) for owned in first_three) == 12
    # Natural order, for contrast: all four ranks pile onto the same shard at every step.
    natural = list(range(12))
    assert all(len({natural[step] for _ in range(4)}) == 1 for step in range(12))


def test_small_tasks_and_one_rank() -> None:
    assert walk_order(12, 1, 4) == [1, 5, 9, 2, 6, 10, 3, 7, 11, 0, 4, 8]
    assert walk_order(3, 0, 4) == [0, 1, 2]  # strides with no entry are skipped
    assert walk_order(0, 3, 4) == []
    assert walk_order(5, 7, 1) == [0, 1, 2, 3, 4]
    assert walk_order(8, 6, 4) == [2, 6, 3, 7, 0, 4, 1, 5]  # 6 % 4 = 2 starts


def test_natural_order_is_the_baseline() -> None:
    assert walk_order(12, 2, 4, rearrange=False) == list(range(12))
    assert walk_order(0, 2, 4, rearrange=False) == []


@given(
    n=st.integers(min_value=0, max_value=600),
    device_id=st.integers(min_value=0, max_value=2**63),
    local_rank_size=st.integers(min_value=1, max_value=64),
)
def test_rearrange_index_is_a_permutation(n: int, device_id: int, local_rank_size: int) -> None:
    order = walk_order(n, device_id, local_rank_size)
    assert sorted(order) == list(range(n))
    # Own stride first, then each following stride in rotation.
    start = device_id % local_rank_size
    expected = [
        i
        for k in range(local_rank_size)
        for i in range((start + k) % local_rank_size, n, local_rank_size)
    ]
    assert order == expected


@given(n=st.integers(min_value=1, max_value=200), ranks=st.integers(min_value=1, max_value=16))
def test_ranks_touch_disjoint_entries_at_every_step(n: int, ranks: int) -> None:
    if n % ranks:
        n = n - n % ranks or ranks  # equal strides: every rank has an entry at every step
    orders = [walk_order(n, rank, ranks) for rank in range(ranks)]
    for step in range(n):
        assert len({order[step] for order in orders}) == ranks


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1, 0, 4), r"n=-1 is not valid: expected an integer in \[0, 16777216\]"),
        ((4, 0, 0), r"local_rank_size=0 is not valid: expected an integer in \[1, 64\]"),
        ((4, 0, 65), r"local_rank_size=65 is not valid: expected an integer in \[1, 64\]"),
        ((4, "0", 4), r"device_id='0' is not valid: expected an integer >= 0"),
        ((4, True, 4), r"device_id=True is not valid"),
        ((4, -1, 4), r"device_id=-1 is not valid: expected an integer >= 0"),
    ],
)
def test_bad_arguments_are_named(args: tuple[object, object, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        walk_order(*args)  # type: ignore[arg-type]
