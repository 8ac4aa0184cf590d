"""RearrangeIndex (seed 000 §3.1): the order in which a rank walks a task's entries.

Every rank of a node receives the same task. Walking it in natural order makes all ranks claim
the same shard at the same moment: one owner loads, the others wait, and the slow tier below
sees one request at a time. Each rank instead starts at ``device_id % local_rank_size`` and
strides by ``local_rank_size`` (its *own stride*), then rotates through the other ranks' strides.
At every step the ranks touch disjoint entries, so they all become owners at once and the tier
below sees ``local_rank_size`` concurrent loads (Scenario A).
"""

from __future__ import annotations

from .errors import InvalidArgumentError


def _check(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgumentError(f"{name}={value!r} is not valid: expected an integer >= {low}")
    return value


def stride_starts(device_id: int, local_rank_size: int) -> list[int]:
    """The offsets of the strides in the order this rank walks them (own stride first)."""
    _check("local_rank_size", local_rank_size, 1)
    if isinstance(device_id, bool) or not isinstance(device_id, int):
        raise InvalidArgumentError(f"device_id={device_id!r} is not valid: expected an integer")
    start = device_id % local_rank_size
    return [(start + k) % local_rank_size for k in range(local_rank_size)]


def rearrange_index(n: int, device_id: int, local_rank_size: int) -> list[int]:
    """A permutation of ``range(n)``: the stride of ``device_id % local_rank_size`` first, then
    the following strides in rotation. Pure; ``device_id`` may be any integer."""
    _check("n", n, 0)
    order: list[int] = []
    for offset in stride_starts(device_id, local_rank_size):
        order.extend(range(offset, n, local_rank_size))
    return order


def rearrange_strides(n: int, device_id: int, local_rank_size: int) -> list[list[int]]:
    """:func:`rearrange_index` cut into its strides (empty strides dropped): the dispatcher
    claims one stride per step."""
    _check("n", n, 0)
    strides = [
        list(range(offset, n, local_rank_size))
        for offset in stride_starts(device_id, local_rank_size)
    ]
    return [stride for stride in strides if stride]
