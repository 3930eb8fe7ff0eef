"""The command-line flags that configure an engine, shared by `serve`, `generate` and `batch`.

Flags left out (None) fall back to the model's registry defaults (configs/*.toml), then to the
config dataclasses' defaults."""

from __future__ import annotations

import argparse


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="registered model name or path (GGUF file, "
                        "HF directory with config.json + *.safetensors, or orbax checkpoint)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    g = parser.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, help="context length (prompt + output)")
    g.add_argument("--max-num-seqs", type=int, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, help="tokens per step")
    g.add_argument("--page-size", type=int, help="tokens per KV page (a power of two)")
    g.add_argument("--num-pages", type=int, help="KV pool size (default: from memory)")
    g.add_argument("--kv-cache-memory-fraction", type=float,
                   help="fraction of the memory left after weights given to the KV cache")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=None)
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   default=None)


_ENGINE_FLAGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size",
                 "num_pages", "kv_cache_memory_fraction", "enable_prefix_caching",
                 "enable_chunked_prefill")


def engine_args(args: argparse.Namespace) -> dict:
    """The flags the user set, as LLMEngine.from_model keyword arguments."""
    return {k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k, None) is not None}
