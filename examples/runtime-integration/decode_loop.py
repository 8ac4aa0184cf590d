"""A toy paged-KV inference loop that uses UCM the way a runtime does.

Each request is a prompt of tokens cut into fixed-size pages (blocks). A block's id is a hash of
every token up to and including it (prefix caching: the same prefix gives the same ids). Before
prefill the loop asks UCM how long a prefix is cached (``lookup_on_prefix``), loads those blocks'
KV straight into its paged KV cache (``load``), computes only the rest, dumps the new blocks
(``dump``) and then decodes a few tokens. Requests share a system prompt and some share whole
documents, so later requests skip most of their prefill. At the end it prints the compute saved.

    python decode_loop.py                      # one rank, a temporary buffer + posix stack
    python decode_loop.py --stack my.yaml      # your own stack (see ../stacks/)
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

import ucm

BLOCK_TOKENS = 16
LAYERS = 4
HIDDEN = 64
KV_BYTES = BLOCK_TOKENS * HIDDEN * 2  # one fp16 K (or V) page of one layer


def default_stack(workdir: Path) -> dict[str, Any]:
    """One node: the shared CacheBuffer over a local directory (NVMe in production)."""
    return {
        "unique_id": f"decode-loop-{uuid.uuid4().hex[:8]}",
        # A shard holds every layer's K and V page of one block: 2 * LAYERS tensors.
        "tensor_size_list": [KV_BYTES] * (2 * LAYERS),
        "shards_per_block": 1,  # one rank; under TP, one shard per rank
        "tiers": [
            {"type": "buffer", "capacity": 256 * 2 * LAYERS * KV_BYTES, "reserved_slots": 16},
            {"type": "posix", "path": str(workdir / "nvme"), "write": "through"},
        ],
    }


class ToyModel:
    """A few dense layers; prefill of a block produces each layer's K and V pages."""

    def __init__(self, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(1000, HIDDEN, generator=generator)
        self.layers = [
            (torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN**0.5,) * 3
            for _ in range(LAYERS)
        ]

    def prefill_block(self, tokens: list[int], kv: list[torch.Tensor]) -> None:
        """Computes a block's KV pages into ``kv`` (K0, V0, K1, V1, ...): the expensive part."""
        x = self.embed[torch.tensor(tokens)]
        for layer, (wq, wk, wv) in enumerate(self.layers):
            for _ in range(40):  # stands in for attention over the context + MLP
                x = torch.tanh(x @ wq)
            kv[2 * layer].copy_((x @ wk).to(torch.float16))
            kv[2 * layer + 1].copy_((x @ wv).to(torch.float16))

    def decode_step(self, kv_pages: list[list[torch.Tensor]], last_token: int) -> int:
        query = self.embed[last_token]
        keys = torch.cat([pages[2 * (LAYERS - 1)] for pages in kv_pages]).float()
        scores = keys @ query
        return int(scores.argmax()) % 1000


def block_ids(tokens: list[int]) -> list[bytes]:
    """Chained hashes: block i's id covers tokens[0 : (i + 1) * BLOCK_TOKENS]."""
    ids, digest = [], b""
    for start in range(0, len(tokens) - len(tokens) % BLOCK_TOKENS, BLOCK_TOKENS):
        page = bytes(str(tokens[start : start + BLOCK_TOKENS]), "ascii")
        digest = hashlib.blake2b(digest + page, digest_size=16).digest()
        ids.append(digest)
    return ids


def requests(count: int) -> list[list[int]]:
    """Prompts sharing a system prompt; every document is asked about several times."""
    system = [(7 * i) % 1000 for i in range(3 * BLOCK_TOKENS)]
    documents = [[(31 * d + 17 * i) % 1000 for i in range(5 * BLOCK_TOKENS)] for d in range(3)]
    prompts = []
    for r in range(count):
        question = [(13 * r + i) % 1000 for i in range(BLOCK_TOKENS)]
        prompts.append(system + documents[r % len(documents)] + question)
    return prompts


def serve(
    store: ucm.Store, model: ToyModel, prompts: list[list[int]], decode: int, verify: bool
) -> dict[str, Any]:
    totals = {"blocks": 0, "loaded": 0, "computed": 0, "compute_s": 0.0, "load_s": 0.0}
    for number, tokens in enumerate(prompts):
        ids = block_ids(tokens)
        kv = [
            [torch.empty(BLOCK_TOKENS, HIDDEN, dtype=torch.float16) for _ in range(2 * LAYERS)]
            for _ in ids
        ]
        cached = store.lookup_on_prefix(ids) + 1
        started = time.perf_counter()
        if cached:
            # Loaded straight into the paged KV cache: one shard per block, shard 0 (one rank).
            store.wait(store.load(ids[:cached], 0, kv[:cached]))
        loaded_s = time.perf_counter() - started
        if verify:  # the loaded pages are exactly what prefill would have computed
            for i in range(cached):
                fresh = [torch.empty_like(page) for page in kv[i]]
                model.prefill_block(tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS], fresh)
                if not all(torch.equal(a, b) for a, b in zip(fresh, kv[i], strict=True)):
                    raise SystemExit(f"request {number}: block {i} loaded from UCM differs")
        started = time.perf_counter()
        for i in range(cached, len(ids)):
            model.prefill_block(tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS], kv[i])
        compute_s = time.perf_counter() - started
        if cached < len(ids):
            store.wait(store.dump(ids[cached:], 0, kv[cached:]))  # for the next request
        token = tokens[-1]
        for _ in range(decode):
            token = model.decode_step(kv, token)
        totals["blocks"] += len(ids)
        totals["loaded"] += cached
        totals["computed"] += len(ids) - cached
        totals["compute_s"] += compute_s
        totals["load_s"] += loaded_s
        print(
            f"request {number:2d}: {len(ids)} blocks, {cached} loaded from UCM, "
            f"{len(ids) - cached} prefilled, next token {token}"
        )
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", help="stack YAML (default: a temporary buffer + posix stack)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--decode", type=int, default=4, help="tokens decoded per request")
    parser.add_argument("--verify", action="store_true", help="recompute loaded blocks, compare")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = ToyModel()
    with tempfile.TemporaryDirectory() as workdir:
        stack: Any = args.stack or default_stack(Path(workdir))
        with ucm.open(stack, device_id=0, local_rank_size=1) as store:
            totals = serve(store, model, requests(args.requests), args.decode, args.verify)
            stats = store.stats()
        if not args.stack:
            from ucm.native import segments

            segments.unlink(stack["unique_id"])
    per_block = totals["compute_s"] / max(1, totals["computed"])
    saved_s = per_block * totals["loaded"]
    share = totals["loaded"] / max(1, totals["blocks"])
    print(
        f"saved {totals['loaded']} of {totals['blocks']} block prefills ({share:.0%}): "
        f"~{saved_s * 1000:.0f} ms of compute for {totals['load_s'] * 1000:.0f} ms of loads; "
        f"buffer hits {stats['hits']}, misses {stats['misses']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
