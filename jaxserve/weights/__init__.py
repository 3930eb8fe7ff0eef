"""Weight loading: every source format yields the same parameter tree (see
jaxserve.executor.models.decoder)."""

from __future__ import annotations

import jax

from jaxserve.config import ModelConfig
from jaxserve.errors import ConfigError, WeightsError
from jaxserve.model_registry import ModelSpec


def load_host(spec: ModelSpec, dtype: str = "float32", keep_blocks: bool = False,
              keep_bf16: bool = False) -> tuple[ModelConfig, dict]:
    """GGUF or HF weights as host numpy arrays (before placement); what `convert` saves.
    keep_blocks: a GGUF file's quantized blocks stay as they are where they can
    (jaxserve.weights.gguf.block_formats; config.quantization "gguf" if any do). keep_bf16: an
    HF checkpoint stored in bf16 keeps its matmul weights bf16 (load_hf)."""
    if spec.format == "gguf":
        from jaxserve.weights.gguf import load_gguf

        return load_gguf(spec.path, dtype, keep_blocks)
    if spec.format == "hf":
        from jaxserve.weights.safetensors import load_hf

        return load_hf(spec.path, dtype, keep_bf16)
    raise _not_generative(spec)


def _not_generative(spec: ModelSpec) -> WeightsError:
    return WeightsError(f"{spec.name} is a {spec.format!r} model, not a generative (Llama-family) "
                        f"one: it serves embeddings and retrieval (jaxserve index / search)")


def read_config(spec: ModelSpec, dtype: str | None = None) -> ModelConfig:
    """The model's ModelConfig without reading its tensors, in the dtype `load_model` would give
    it (None: f32 for GGUF / HF, as saved for orbax)."""
    if spec.format == "orbax":
        from jaxserve.weights.checkpoint import config_from_dict, read_meta

        config = config_from_dict(read_meta(spec.path)["config"])
        return config.replace(dtype=dtype) if dtype is not None else config
    if spec.format == "gguf":
        from jaxserve.weights.gguf import read_gguf_config

        return read_gguf_config(spec.path, dtype or "float32")
    if spec.format == "hf":
        from jaxserve.weights.safetensors import read_hf_config

        return read_hf_config(spec.path, dtype or "float32")
    raise _not_generative(spec)


def param_bytes(config: ModelConfig) -> int:
    """Device bytes of the parameters (before any sharding)."""
    import numpy as np

    from jaxserve.executor.models import decoder

    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
               for s in jax.tree.leaves(decoder.param_shapes(config)))


def resolve_quantization(spec: ModelSpec, quantization: str | None, dtype: str | None = None,
                         mesh: jax.sharding.Mesh | None = None) -> str | None:
    """The weight storage a load asks for. "none": the source's dtype; "int8" / "gguf" as asked
    (gguf needs a GGUF file). None (unset): "gguf" for a GGUF file computed in f32 on one device
    where the CPU kernels run, which read its Q4_0 / Q4_1 / Q8_0 blocks in place (the loader keeps
    them where it can: jaxserve.weights.gguf.block_formats; else the f32 load); the source's dtype
    everywhere else (a mesh, bf16, an accelerator: there the blocks would be dequantized by XLA
    every step)."""
    if quantization == "none":
        return None
    if quantization == "gguf" and spec.format != "gguf":
        raise ConfigError(f"quantization 'gguf' needs a GGUF file, not a {spec.format!r} "
                          f"source ({spec.name})")
    if quantization is None and spec.format == "gguf" and mesh is None \
            and (dtype or "float32") == "float32":
        from jaxserve.kernels import cpu as cpu_kernels

        return "gguf" if cpu_kernels.enabled() else None
    return quantization


def load_model(spec: ModelSpec, dtype: str | None = None, mesh: jax.sharding.Mesh | None = None,
               quantization: str | None = None,
               expert_parallel: bool = False) -> tuple[ModelConfig, dict]:
    """(config, params on device). dtype None keeps the source's (f32 for GGUF / HF, as saved for
    orbax); with a mesh, params are sharded for tensor parallelism (jaxserve.executor.sharding),
    a mixture's experts by expert with `expert_parallel`.
    quantization (`resolve_quantization`): "int8": the layers' projections stored as int8 groups
    (weights.quantize); "gguf": a GGUF file's blocks kept as they are (weights.gguf); None: the
    default for the source; "none": no quantization."""
    from jaxserve.executor.models import decoder

    quantization = resolve_quantization(spec, quantization, dtype, mesh)
    if quantization is not None and spec.format == "orbax":
        raise ConfigError(f"quantization {quantization!r} needs a GGUF or HF source, not an orbax "
                          f"checkpoint ({spec.name})")
    if spec.format == "orbax":
        from jaxserve.weights.checkpoint import config_from_dict, load_checkpoint, read_meta

        shardings = None
        if mesh is not None:
            config = config_from_dict(read_meta(spec.path)["config"])
            shardings = decoder.param_shardings(config.replace(
                dtype=dtype or config.dtype, expert_parallel=expert_parallel), mesh)
        config, params = load_checkpoint(spec.path, dtype, shardings)
        return config.replace(expert_parallel=expert_parallel), params
    # A bf16 checkpoint computed in f32 by the CPU kernels keeps its matmul weights bf16: the
    # kernels widen them in registers (half the bytes a step streams, the same floats), every
    # other path where it uses them. Not on GPU / TPU, where the kernels are not used.
    from jaxserve.kernels import cpu as cpu_kernels

    keep_bf16 = ((dtype or "float32") == "float32" and quantization is None
                 and cpu_kernels.enabled())
    config, params = load_host(spec, dtype or "float32", keep_blocks=quantization == "gguf",
                               keep_bf16=keep_bf16)
    if quantization != "gguf":  # (else the loader's: "gguf" if it kept any blocks)
        config = config.replace(quantization=quantization)
    config = config.replace(expert_parallel=expert_parallel)
    if config.quantization == "int8":
        from jaxserve.weights.quantize import quantize_int8

        params = quantize_int8(params)
    if mesh is None:
        return config, jax.device_put(params)
    return config, jax.device_put(params, decoder.param_shardings(config, mesh))


def load_model_replicas(spec: ModelSpec, dtype: str | None, meshes: list[jax.sharding.Mesh | None],
                        quantization: str | None = None,
                        expert_parallel: bool = False) -> tuple[ModelConfig, list[dict]]:
    """The weights read once and placed on each mesh (one per data-parallel replica): the first
    from the source, the others copied device to device from it."""
    from jaxserve.executor.models import decoder

    config, first = load_model(spec, dtype, meshes[0], quantization, expert_parallel)
    return config, [first] + [jax.device_put(first, decoder.param_shardings(config, mesh))
                              for mesh in meshes[1:]]
