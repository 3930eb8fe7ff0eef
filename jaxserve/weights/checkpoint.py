"""Orbax checkpoints written by `jaxserve convert`: params + jaxserve_model.json (the ModelConfig).

A checkpoint stores the parameter tree as is, so loading skips dequantization and re-layout, and
orbax restores each array straight into its target sharding (no full copy on one host first).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax

from jaxserve.config import MlaConfig, ModelConfig, RopeScaling
from jaxserve.errors import WeightsError

MODEL_JSON = "jaxserve_model.json"
PARAMS_DIR = "params"


def config_to_dict(config: ModelConfig) -> dict:
    return dataclasses.asdict(config)


def _tuples(d: dict) -> dict:
    # JSON has no tuples: the frozen configs' tuple fields come back as lists.
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def config_from_dict(d: dict) -> ModelConfig:
    d = _tuples(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**_tuples(d["rope_scaling"]))
    if d.get("mla") is not None:
        d["mla"] = MlaConfig(**d["mla"])
    return ModelConfig(**d)


def save_checkpoint(dst: Path, config: ModelConfig, params, tokenizer_source: str | None) -> None:
    """Write params and the config; `tokenizer_source` (a .gguf or tokenizer.json) is recorded so
    the checkpoint can be served with the tokenizer of the model it came from."""
    import orbax.checkpoint as ocp

    dst = Path(dst).resolve()
    if dst.exists():
        raise WeightsError(f"{dst}: already exists; choose a new destination or delete it")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(dst / PARAMS_DIR, params)
    meta = {"config": config_to_dict(config), "tokenizer_source": tokenizer_source}
    (dst / MODEL_JSON).write_text(json.dumps(meta, indent=2))


def read_meta(path: Path) -> dict:
    try:
        return json.loads((Path(path) / MODEL_JSON).read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"{Path(path) / MODEL_JSON}: unreadable ({e})") from None


def load_checkpoint(path: Path, dtype: str | None = None,
                    shardings=None) -> tuple[ModelConfig, dict]:
    """Restore params, cast to `dtype` (None: as saved), placed by `shardings` (a tree of
    jax.sharding.Sharding like the params; None: the default device)."""
    import orbax.checkpoint as ocp

    from jaxserve.executor.models import decoder

    path = Path(path).resolve()
    config = config_from_dict(read_meta(path)["config"])
    if dtype is not None:
        config = config.replace(dtype=dtype)
    shapes = decoder.param_shapes(config)
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, shapes)
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          shapes, shardings)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(path / PARAMS_DIR, target)
    except Exception as e:  # orbax raises many types on missing / mismatched / corrupted files
        raise WeightsError(f"{path}: cannot restore the orbax checkpoint ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return config, params
