"""The command-line flags that configure an engine, shared by `serve`, `generate`, `batch` and
`manifest`, and the same settings as a deployment file's version table spells them.

Flags left out (None) fall back to the model's registry defaults (configs/*.toml), then to the
config dataclasses' defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxserve.config import QUANTIZATIONS, DistributedConfig

DTYPES = ("float32", "bfloat16")
# Engine settings by their keyword name (the flag is --name-with-dashes) and value type.
ENGINE_FLAG_TYPES = {
    "max_model_len": int, "max_num_seqs": int, "max_num_batched_tokens": int,
    "min_token_bucket": int, "page_size": int, "num_pages": int, "kv_cache_memory_fraction": float,
    "enable_prefix_caching": bool, "enable_chunked_prefill": bool, "chat_template": str,
    "tensor_parallel_size": int, "data_parallel_size": int, "speculative_ngram": int,
    "speculative_config": str, "quantization": str, "kv_cache_dtype": str,
}


def add_engine_arguments(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    parser.add_argument("--model", required=model_required,
                        help="registered model name or path (GGUF file, HF directory with "
                             "config.json + *.safetensors, or orbax checkpoint)")
    add_engine_flags(parser)
    parser.add_argument("--compile-cache-dir", default=None,
                        help="JAX's persistent compilation cache: a second start of the same "
                             "model skips XLA compilation (default: the jaxserve cache's xla/; "
                             "'' turns it off)")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine settings without --model (for commands that name the model otherwise)."""
    parser.add_argument("--dtype", choices=DTYPES, default=None)
    parser.add_argument("--quantization", "-q", choices=QUANTIZATIONS[1:], default=None,
                        help="int8: the decoder layers' weights stored as int8 groups of 32 "
                             "(a quarter of the f32 bytes; faster at small batches on CPU)")
    parser.add_argument("--kv-cache-dtype", choices=DTYPES, default=None,
                        help="the KV cache's element type (default: the model's dtype); "
                             "bfloat16 halves its memory (golden greedy tokens unchanged on "
                             "SmolLM2)")
    g = parser.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, help="context length (prompt + output)")
    g.add_argument("--max-num-seqs", type=int, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, help="tokens per step")
    g.add_argument("--min-token-bucket", type=int,
                   help="the smallest step the forward is compiled for, a power of two (default "
                        "1; 16 on an accelerator saves compile time)")
    g.add_argument("--page-size", type=int, help="tokens per KV page (a power of two)")
    g.add_argument("--num-pages", type=int, help="KV pool size (default: from memory)")
    g.add_argument("--kv-cache-memory-fraction", type=float,
                   help="fraction of the memory left after weights given to the KV cache")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=None)
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   default=None)
    g.add_argument("--speculative-ngram", type=int, metavar="K",
                   help="speculative decoding: up to K draft tokens per step copied from the "
                        "sequence's own prompt and output (n-gram lookup); 0 or absent: off")
    g.add_argument("--speculative-config", metavar="JSON",
                   help='vLLM\'s form, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 3}\'')
    g.add_argument("--chat-template", help="a jinja chat template file (or the template itself) "
                   "to use instead of the model's")
    g.add_argument("--tensor-parallel-size", "-tp", type=int,
                   help="devices each replica's params and KV cache are sharded over")
    g.add_argument("--data-parallel-size", "-dp", type=int,
                   help="engine replicas in this process, each on its own tensor-parallel-size "
                        "devices, behind one front door")


def add_deployment_arguments(parser: argparse.ArgumentParser) -> None:
    """--model or --deployment (`serve` and `batch` alike): one model, or the versions and
    routes of a deployment file; `check_model_or_deployment` checks one was given."""
    add_engine_arguments(parser, model_required=False)
    parser.add_argument("--deployment", type=Path, default=None, metavar="FILE",
                        help="the model versions and routes of this TOML file (README 'Model "
                             "versions'; in place of --model, whose engine flags then do not "
                             "apply: each version has its own); a request's 'model' names a "
                             "route or a version")


def check_model_or_deployment(args: argparse.Namespace) -> None:
    from jaxserve.errors import ConfigError

    if (args.model is None) == (args.deployment is None):
        raise ConfigError("give either --model (one model) or --deployment FILE (versions and "
                          "routes), not both")


def start_fleet(path: Path, *, progress: bool = True, stall_timeout: float | None = 60.0):
    """Every version of a deployment file loaded and compiled, its routes installed (a Fleet);
    one ConfigError naming the file and the field for any problem with it."""
    from jaxserve.fleet.fleet import Fleet
    from jaxserve.fleet.loader import EngineLoader

    return Fleet.from_deployment(path, EngineLoader(progress=progress,
                                                    stall_timeout=stall_timeout))


def one_version_fleet(args: argparse.Namespace, name: str, engine, loader=None):
    """--model (`serve` and `batch` alike) as a fleet of one version named as clients address
    it, with its manifest (its system_fingerprint) and pricing; `loader` (an EngineLoader) lets
    versions be loaded beside it."""
    from jaxserve.fleet.deployment import VersionSpec
    from jaxserve.fleet.fleet import Fleet
    from jaxserve.fleet.manifest import manifest_of
    from jaxserve.gateway.pricing import pricing_for

    spec = VersionSpec(name, args.model, args.dtype, tuple(sorted(engine_args(args).items())))
    return Fleet.of_engine(name, engine, manifest=manifest_of(spec),
                           pricing=pricing_for(args.model), loader=loader)


def engine_args(args: argparse.Namespace) -> dict:
    """The flags the user set, as LLMEngine.from_model keyword arguments."""
    return {k: getattr(args, k) for k in ENGINE_FLAG_TYPES if getattr(args, k, None) is not None}


def configure_compile_cache(args: argparse.Namespace) -> None:
    """Turn on JAX's persistent compilation cache for a command that builds an engine."""
    from jaxserve.executor.compile_cache import default_compile_cache_dir, enable_compile_cache

    if args.compile_cache_dir != "":
        enable_compile_cache(Path(args.compile_cache_dir) if args.compile_cache_dir
                             else default_compile_cache_dir())


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "multi-host", "one server over the devices of several processes (jax.distributed): "
        "process 0 serves, the others follow its steps")
    g.add_argument("--coordinator-address", help="HOST:PORT of process 0 (jax.distributed)")
    g.add_argument("--num-processes", type=int, help="processes in the group")
    g.add_argument("--process-id", type=int, help="this process's index (0: the leader)")
    g.add_argument("--distributed", action="store_true",
                   help="initialise jax.distributed even without the three flags above: JAX "
                        "detects them from the environment (TPU pod slices, SLURM, Open MPI)")


def distributed_config(args: argparse.Namespace) -> DistributedConfig | None:
    """The multi-host settings, or None for a single process."""
    given = (args.coordinator_address, args.num_processes, args.process_id)
    if not args.distributed and all(v is None for v in given):
        return None
    return DistributedConfig(*given)
