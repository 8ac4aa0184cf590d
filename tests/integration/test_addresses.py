"""KV blocks as addresses (``ucm.integration.addresses``): the addresses a step computes by array
arithmetic are byte for byte those of the per-layer tensor views the connector passed before,
over every layout it accepts; transfers through them are byte-exact; bad registrations and bad
block numbers are refused with errors that name them."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import ucm  # noqa: E402
from ucm.errors import ConfigError, InvalidArgumentError  # noqa: E402
from ucm.integration.addresses import BlockAddresses, block_view  # noqa: E402

BLOCKS = 7


def _vllm_cpu() -> torch.Tensor:
    """vLLM CPU's cache: [blocks, kv_heads, block_size, 2 * head_size], contiguous."""
    return torch.randn(BLOCKS, 2, 16, 2 * 8)


def _nhd_as_hnd() -> torch.Tensor:
    """Stored [blocks, block_size, heads, dim], seen as [blocks, heads, block_size, dim]
    (a stride-permuted layout: the view puts the dimensions back in memory order)."""
    return torch.randn(BLOCKS, 16, 4, 8).permute(0, 2, 1, 3)


def _mla() -> torch.Tensor:
    """MLA's latent cache: [blocks, block_size, kv_lora_rank + rope dim], one tensor."""
    return torch.randn(BLOCKS, 16, 40, dtype=torch.bfloat16)


def _padded() -> torch.Tensor:
    """Blocks further apart than their size (a padded allocation): stride != size."""
    return torch.randn(BLOCKS, 2, 48, dtype=torch.float16)[:, :, :32].contiguous()[:, :1]


def _shared_allocation() -> torch.Tensor:
    """A layer viewed out of one raw byte allocation, at an offset (how vLLM carves layers'
    caches out of shared ``kv_cache_tensors``): fp8-sized elements."""
    raw = torch.randint(0, 255, (3 * BLOCKS * 256,), dtype=torch.uint8)
    return raw[BLOCKS * 256 : 2 * BLOCKS * 256].view(BLOCKS, 4, 64)


LAYOUTS: dict[str, Callable[[], torch.Tensor]] = {
    "vllm-cpu": _vllm_cpu,
    "nhd-permuted": _nhd_as_hnd,
    "mla": _mla,
    "padded-stride": _padded,
    "shared-allocation": _shared_allocation,
}


def _views(kinds: list[str]) -> tuple[list[torch.Tensor], list[int]]:
    views = []
    for i, kind in enumerate(kinds):
        kv = LAYOUTS[kind]()
        size = kv[0].numel() * kv.element_size()
        views.append(block_view(kv, BLOCKS, size, f"layer {i}"))
    return views, [int(v[0].nbytes) for v in views]


@pytest.mark.parametrize(
    "kinds",
    [
        ["vllm-cpu"] * 3,
        ["nhd-permuted", "nhd-permuted"],
        ["mla"] * 4,
        ["padded-stride", "vllm-cpu"],
        ["shared-allocation", "mla", "nhd-permuted"],
    ],
    ids=lambda kinds: "+".join(kinds),
)
def test_addresses_equal_the_tensor_views_addresses(kinds: list[str]) -> None:
    views, sizes = _views(kinds)
    addresses = BlockAddresses(views, sizes, [f"l{i}" for i in range(len(kinds))], BLOCKS)
    blocks = [6, 0, 3, 3, 5, 1]
    expected = [view[b].data_ptr() for b in blocks for view in views]
    assert list(addresses.of(blocks)) == expected
    assert addresses.bases == [view.data_ptr() for view in views]
    if "padded-stride" in kinds:
        assert addresses.strides[0] != sizes[0]


@pytest.mark.parametrize("rank", [0, 1])
def test_dumps_and_loads_through_addresses_are_byte_exact(tmp_path: Path, rank: int) -> None:
    """Through the address path at TP rank ``rank`` of 2: dumped blocks read back through
    tensor views equal the source blocks, and loads through addresses write exactly the
    destination blocks (the other blocks keep their bytes)."""
    views, sizes = _views(["vllm-cpu", "nhd-permuted", "mla", "shared-allocation"])
    names = [f"l{i}" for i in range(len(views))]
    stack = {
        "unique_id": f"addr-{uuid.uuid4().hex[:10]}",
        "tensor_size_list": sizes,
        "shards_per_block": 2,
        "tiers": [{"type": "buffer", "capacity": 64 * sum(sizes)}],
    }
    ids = [bytes([i]) * 16 for i in range(1, 4)]
    with ucm.open(stack, device_id=rank, local_rank_size=2) as store:
        source = BlockAddresses(views, sizes, names, BLOCKS)
        store.wait(store.dump_data(ids, rank, source.of([4, 1, 6])))
        for block_id, block in zip(ids, [4, 1, 6], strict=True):
            back = [torch.zeros_like(view[block]) for view in views]
            store.wait(store.load([block_id], rank, [back]))
            for got, view in zip(back, views, strict=True):
                assert torch.equal(got.view(torch.uint8), view[block].view(torch.uint8))
        targets = [torch.zeros_like(view) for view in views]
        before = [t.clone() for t in targets]
        destination = BlockAddresses(targets, sizes, names, BLOCKS)
        store.wait(store.load_data(ids, rank, destination.of([0, 2, 5])))
        for target, view, old in zip(targets, views, before, strict=True):
            for into, outof in ((0, 4), (2, 1), (5, 6)):
                assert torch.equal(target[into].view(torch.uint8), view[outof].view(torch.uint8))
            for untouched in (1, 3, 4, 6):
                assert torch.equal(target[untouched], old[untouched])


def test_a_block_out_of_range_is_named() -> None:
    views, sizes = _views(["vllm-cpu"])
    addresses = BlockAddresses(views, sizes, ["l0"], BLOCKS)
    with pytest.raises(InvalidArgumentError, match=r"blocks\[2\]=7 is out of range: .* \[0, 7\)"):
        addresses.of([0, 1, 7])
    with pytest.raises(InvalidArgumentError, match=r"blocks\[0\]=-1 is out of range"):
        addresses.of([-1, 1])
    with pytest.raises(InvalidArgumentError, match="flat list of block numbers"):
        addresses.of([0.5])  # type: ignore[list-item]
    assert len(addresses.of([])) == 0


def test_bad_registrations_are_refused_naming_the_layer() -> None:
    kv = _vllm_cpu()
    size = kv[0].nbytes
    with pytest.raises(ConfigError, match=r"layer 'a' has shape \(7, 2, 16, 16\); expected 5"):
        BlockAddresses([kv], [size], ["a"], 5)
    with pytest.raises(ConfigError, match=rf"layer 'a' .* not keep one block in {size + 4}"):
        BlockAddresses([kv], [size + 4], ["a"], BLOCKS)
    overlapping = kv[:1].expand(BLOCKS, -1, -1, -1)  # every block at one address
    with pytest.raises(ConfigError, match=r"layer 'b': blocks are 0 bytes apart .* overlap"):
        BlockAddresses([overlapping], [size], ["b"], BLOCKS)
    with pytest.raises(ConfigError, match=r"layer 'c' is on meta"):
        BlockAddresses([torch.empty(BLOCKS, 8, device="meta")], [32], ["c"], BLOCKS)
    with pytest.raises(ConfigError, match=r"layer 'd' must be a torch.Tensor, got list"):
        BlockAddresses([[1, 2]], [8], ["d"], BLOCKS)  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=r"1 layer view.*2 size"):
        BlockAddresses([kv], [size, size], ["a"], BLOCKS)
    with pytest.raises(ConfigError, match=r"kv \(shape \(7, 16, 4, 8\), strides .* 512 contig"):
        block_view(torch.randn(BLOCKS, 16, 8, 8)[:, :, :4], BLOCKS, 512, "kv")
