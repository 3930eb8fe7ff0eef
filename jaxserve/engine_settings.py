"""The engine settings, each declared once: its name, type, help and what it feeds.

The command-line flags (jaxserve.entrypoints.engine_flags), the version fields of a deployment file
(jaxserve.fleet.deployment) and `make_engine_config` (flat settings -> EngineConfig) are all read
off `SETTINGS`. A setting left out falls back to the model's registry defaults (the [engine] table
of configs/*.toml), then to the config dataclass's default: that is why no setting carries a
default of its own here.

What a setting feeds: CacheConfig, SchedulerConfig or ParallelConfig (`field` names the config's
field where it differs), the speculative config, or the weights and tokenizer loading itself
(LOAD: dtype, quantization, gguf_dot, chat_template, read by the engine factory, not by
EngineConfig).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config import (GGUF_DOTS, QUANTIZATIONS, CacheConfig, EngineConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig)
from jaxserve.errors import ConfigError, ContextLengthExceeded, InvalidRequest

DTYPES = ("float32", "bfloat16")
CACHE, SCHEDULER, PARALLEL, SPECULATIVE, LOAD = (
    "cache", "scheduler", "parallel", "speculative", "load")


@dataclass(frozen=True)
class Setting:
    name: str  # keyword argument and deployment-file field; the flag is --name-with-dashes
    type: type  # int, float, bool (a switch that turns the setting off) or str
    feeds: str  # CACHE, SCHEDULER, PARALLEL, SPECULATIVE or LOAD
    help: str | None = None
    field: str | None = None  # the config's field, when it is not `name`
    choices: tuple[str, ...] | None = None
    short: str | None = None  # a short flag, e.g. -tp
    metavar: str | None = None
    grouped: bool = True  # listed under the "engine" heading of --help
    switch_on: bool = False  # a bool setting that defaults to off: its flag turns it on

    @property
    def flag(self) -> str:
        # A bool setting defaults to on: its flag turns it off (enable_x -> --no-x), unless it
        # is a switch_on one (enable_x -> --enable-x, vLLM's spelling).
        if self.type is not bool or self.switch_on:
            return "--" + self.name.replace("_", "-")
        return "--no-" + self.name.removeprefix("enable_").replace("_", "-")

    @property
    def config_field(self) -> str:
        return self.field or self.name


SETTINGS = (
    Setting("dtype", str, LOAD, choices=DTYPES, grouped=False),
    Setting("quantization", str, LOAD, choices=(*QUANTIZATIONS[1:], "none"), short="-q",
            grouped=False,
            help="gguf: a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks kept as they are and read in "
                 "place by the CPU kernel (the default for a GGUF file computed in float32 on one "
                 "CPU device; elsewhere the default is none); none: dequantized to --dtype at "
                 "load; int8: the decoder layers' weights stored as int8 groups of 32 with an "
                 "f32 scale and minimum (1.25 bytes a weight), read in place by the CPU kernel "
                 "too"),
    Setting("gguf_dot", str, LOAD, choices=GGUF_DOTS, grouped=False,
            help="with a GGUF file's blocks (--quantization gguf), steps of up to 4 tokens (one "
                 "user's decodes): int8 rounds the activations to int8 per block of 32 and takes "
                 "the CPU's integer dot products, as llama.cpp does (faster; moves the logits: 3 "
                 "of the 6 golden prompts' greedy tokens change); f32 (the default) keeps them "
                 "f32"),
    Setting("kv_cache_dtype", str, CACHE, field="dtype", choices=DTYPES, grouped=False,
            help="the KV cache's element type (default: the model's dtype); bfloat16 halves its "
                 "memory (SmolLM2's golden greedy tokens unchanged but for near ties: a top two "
                 "within ~0.01 of logprob may swap)"),
    Setting("max_model_len", int, SCHEDULER, help="context length (prompt + output)"),
    Setting("max_num_seqs", int, SCHEDULER, help="sequences per step"),
    Setting("max_num_batched_tokens", int, SCHEDULER, help="tokens per step"),
    Setting("min_token_bucket", int, SCHEDULER,
            help="the smallest step the forward is compiled for, a power of two (default 1; 16 "
                 "on an accelerator saves compile time)"),
    Setting("page_size", int, CACHE, help="tokens per KV page (a power of two)"),
    Setting("num_pages", int, CACHE, help="KV pool size (default: from memory)"),
    Setting("kv_cache_memory_fraction", float, CACHE,
            help="fraction of the memory left after weights given to the KV cache"),
    Setting("enable_prefix_caching", bool, CACHE),
    Setting("kv_offloading_size", float, CACHE, metavar="GIB",
            help="GiB of host memory per engine replica for prefix-cache pages the device pool "
                 "evicts: copied there, and back on a prefix hit instead of recomputed "
                 "(default 0: off)"),
    Setting("kv_offloading_disk_path", str, CACHE, metavar="DIR",
            help="a third prefix-cache tier on local disk: pages the host tier evicts are "
                 "written to files here and read back (checked) on a prefix hit; the directory "
                 "is made 0700, must be empty or an earlier run's, and is emptied at start "
                 "(needs --kv-offloading-size and --kv-offloading-disk-size)"),
    Setting("kv_offloading_disk_size", float, CACHE, metavar="GIB",
            help="GiB of files for the disk tier per engine (least recently used out first)"),
    Setting("enable_chunked_prefill", bool, SCHEDULER),
    Setting("async_scheduling", bool, SCHEDULER,
            help="turn off async scheduling (vLLM's --async-scheduling, on here by default): "
                 "each step launched before the previous one's tokens are read, so the host's "
                 "scheduling and output processing overlap the device; steps with grammar, "
                 "penalty or speculative rows wait for their tokens either way"),
    Setting("deterministic", bool, SCHEDULER, switch_on=True,
            help="batch-invariant numerics: every step padded to max-num-batched-tokens (one "
                 "compiled shape) and each prompt cut into the same prefill chunks whatever else "
                 "runs, so a request's log-probabilities and greedy tokens are bit-identical "
                 "alone or in any batch; steps cost a full step's time (not with speculative "
                 "decoding)"),
    Setting("speculative_ngram", int, SPECULATIVE, metavar="K",
            help="speculative decoding: up to K draft tokens per step copied from the "
                 "sequence's own prompt and output (n-gram lookup); 0 or absent: off"),
    Setting("speculative_config", str, SPECULATIVE, metavar="JSON",
            help='vLLM\'s form, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                 '"prompt_lookup_max": 4, "prompt_lookup_min": 3}\''),
    Setting("chat_template", str, LOAD,
            help="a jinja chat template file (or the template itself) to use instead of the "
                 "model's"),
    Setting("tensor_parallel_size", int, PARALLEL, short="-tp",
            help="devices each replica's params and KV cache are sharded over"),
    Setting("data_parallel_size", int, PARALLEL, short="-dp",
            help="engine replicas in this process, each on its own tensor-parallel-size "
                 "devices, behind one front door"),
    Setting("enable_expert_parallel", bool, PARALLEL, switch_on=True,
            help="a mixture of experts' experts sharded over each replica's "
                 "tensor-parallel-size devices (which must divide their number), tokens "
                 "dispatched to them; attention stays tensor parallel"),
)
BY_NAME = {s.name: s for s in SETTINGS}


def _feeding(feeds: str, args: dict) -> dict:
    """The given settings that feed `feeds`, by the config's field names."""
    return {s.config_field: args[s.name] for s in SETTINGS
            if s.feeds == feeds and args.get(s.name) is not None}


def parallel_config(args: dict) -> ParallelConfig:
    return ParallelConfig(**_feeding(PARALLEL, args))


def make_engine_config(model_config, args: dict) -> EngineConfig:
    """EngineConfig from settings by name (registry defaults overridden by the caller's; the LOAD
    settings are the loader's and are not read here). max_model_len defaults to the model's
    context. Speculative decoding: `speculative_config` (vLLM's: a dict, its JSON text, or a
    SpeculativeConfig) or `speculative_ngram` k, short for
    {"method": "ngram", "num_speculative_tokens": k}."""
    args = {k: v for k, v in args.items() if v is not None}
    unknown = set(args) - set(BY_NAME)
    if unknown:
        raise InvalidRequest(f"unknown engine arguments: {sorted(unknown)}")
    if args.get("deterministic"):  # a prefix-cache hit would move where a prompt's chunks fall
        args.setdefault("enable_prefix_caching", False)
    max_len = args.setdefault("max_model_len", model_config.max_position_embeddings)
    if max_len > model_config.max_position_embeddings:
        raise ContextLengthExceeded(
            f"max_model_len {max_len} exceeds the model's context of "
            f"{model_config.max_position_embeddings}", "max_model_len")
    return EngineConfig(model_config, CacheConfig(**_feeding(CACHE, args)),
                        SchedulerConfig(**_feeding(SCHEDULER, args)), parallel_config(args),
                        _speculative_config(args))


def _speculative_config(args: dict) -> SpeculativeConfig | None:
    spec, k = args.get("speculative_config"), args.get("speculative_ngram")
    if spec is not None and k is not None:
        raise ConfigError("give speculative_config or speculative_ngram, not both")
    if k is not None:
        return SpeculativeConfig(num_speculative_tokens=k) if k else None
    return SpeculativeConfig.parse(spec) if spec is not None else None
