"""The command-line flags that configure an engine, shared by `serve`, `generate`, `batch` and
`manifest`: one per engine setting of jaxserve.engine_settings (which a deployment file's version
table spells by name), plus the model, the compilation cache and the multi-host group.

Flags left out (None) fall back to the model's registry defaults (configs/*.toml), then to the
config dataclasses' defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxserve.config import DistributedConfig
from jaxserve.engine_settings import SETTINGS, Setting
from jaxserve.entrypoints.kernels import add_cpu_kernels_argument


def add_engine_arguments(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    parser.add_argument("--model", required=model_required,
                        help="registered model name or path (GGUF file, HF directory with "
                             "config.json + *.safetensors, or orbax checkpoint)")
    add_engine_flags(parser)
    parser.add_argument("--compile-cache-dir", default=None,
                        help="JAX's persistent compilation cache: a second start of the same "
                             "model skips XLA compilation (default: the jaxserve cache's xla/; "
                             "'' turns it off)")
    add_cpu_kernels_argument(parser)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine settings without --model (for commands that name the model otherwise)."""
    for setting in SETTINGS:
        if not setting.grouped:
            _add_flag(parser, setting)
    group = parser.add_argument_group("engine")
    for setting in SETTINGS:
        if setting.grouped:
            _add_flag(group, setting)


def _add_flag(parser, setting: Setting) -> None:
    names = (setting.flag,) + ((setting.short,) if setting.short else ())
    # Every flag defaults to None (left out): the registry's default, then the config's, applies.
    kwargs = {"dest": setting.name, "default": None, "help": setting.help}
    if setting.type is bool:
        kwargs["action"] = "store_true" if setting.switch_on else "store_false"
    else:
        kwargs.update(type=setting.type, choices=setting.choices, metavar=setting.metavar)
    parser.add_argument(*names, **kwargs)


def add_deployment_arguments(parser: argparse.ArgumentParser) -> None:
    """--model or --deployment (`serve` and `batch` alike): one model, or the versions and
    routes of a deployment file; `check_model_or_deployment` checks one was given."""
    add_engine_arguments(parser, model_required=False)
    parser.add_argument("--deployment", type=Path, default=None, metavar="FILE",
                        help="the model versions and routes of this TOML file (docs/fleet.md; "
                             "in place of --model, whose engine flags then do not "
                             "apply: each version has its own); a request's 'model' names a "
                             "route or a version")


def check_model_or_deployment(args: argparse.Namespace) -> None:
    from jaxserve.errors import ConfigError

    if (args.model is None) == (args.deployment is None):
        raise ConfigError("give either --model (one model) or --deployment FILE (versions and "
                          "routes), not both")


def engine_args(args: argparse.Namespace) -> dict:
    """The engine settings the user set, by name (the engine factory's keyword arguments)."""
    return {s.name: getattr(args, s.name) for s in SETTINGS
            if getattr(args, s.name, None) is not None}


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
