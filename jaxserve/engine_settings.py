"""The engine settings, and EngineConfig from them (flat keyword arguments -> the config
dataclasses)."""

from __future__ import annotations

from jaxserve.config import (CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig)
from jaxserve.errors import ConfigError, ContextLengthExceeded, InvalidRequest

_CACHE_FIELDS = ("page_size", "num_pages", "kv_cache_memory_fraction", "enable_prefix_caching")
_SCHEDULER_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "enable_chunked_prefill", "min_token_bucket")


def parallel_config(args: dict) -> ParallelConfig:
    return ParallelConfig(**{k: args[k] for k in ("tensor_parallel_size", "data_parallel_size")
                             if args.get(k) is not None})


def make_engine_config(model_config, args: dict) -> EngineConfig:
    """EngineConfig from flat engine arguments (registry defaults overridden by the caller's).
    max_model_len defaults to the model's context. Speculative decoding: `speculative_config`
    (vLLM's: a dict, its JSON text, or a SpeculativeConfig) or `speculative_ngram` k, short for
    {"method": "ngram", "num_speculative_tokens": k}."""
    args = {k: v for k, v in args.items() if v is not None}
    unknown = set(args) - set(_CACHE_FIELDS) - set(_SCHEDULER_FIELDS) - {
        "kv_cache_dtype", "tensor_parallel_size", "data_parallel_size", "speculative_config",
        "speculative_ngram"}
    if unknown:
        raise InvalidRequest(f"unknown engine arguments: {sorted(unknown)}")
    max_len = args.setdefault("max_model_len", model_config.max_position_embeddings)
    if max_len > model_config.max_position_embeddings:
        raise ContextLengthExceeded(
            f"max_model_len {max_len} exceeds the model's context of "
            f"{model_config.max_position_embeddings}", "max_model_len")
    cache = CacheConfig(dtype=args.get("kv_cache_dtype"),
                        **{k: args[k] for k in _CACHE_FIELDS if k in args})
    scheduler = SchedulerConfig(**{k: args[k] for k in _SCHEDULER_FIELDS if k in args})
    return EngineConfig(model_config, cache, scheduler, parallel_config(args),
                        _speculative_config(args))


def _speculative_config(args: dict) -> SpeculativeConfig | None:
    spec, k = args.get("speculative_config"), args.get("speculative_ngram")
    if spec is not None and k is not None:
        raise ConfigError("give speculative_config or speculative_ngram, not both")
    if k is not None:
        return SpeculativeConfig(num_speculative_tokens=k) if k else None
    return SpeculativeConfig.parse(spec) if spec is not None else None
