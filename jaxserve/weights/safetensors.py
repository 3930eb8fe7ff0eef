"""HF model directories: config.json (llama / mistral / qwen2) + *.safetensors, sharded or not."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.errors import ConfigError, WeightsError
from jaxserve.weights.hf_layout import params_from_hf

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
INDEX_FILE = "model.safetensors.index.json"


def _rope_scaling(cfg: dict) -> RopeScaling | None:
    rs = cfg.get("rope_scaling") or None
    if rs is None:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        return None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return RopeScaling(rope_type=kind, **{k: rs[k] for k in keys if k in rs})


def config_from_hf(cfg: dict, name: str, dtype: str = "float32") -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise WeightsError(
            f"{name}: unsupported model_type {model_type!r} in config.json (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)})")
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    window = cfg.get("sliding_window")
    if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
        window = None  # Qwen2 configs carry a window size that is off unless explicitly enabled
    return ModelConfig(
        name=name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta", 10000.0),
        rope_scaling=_rope_scaling(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
        sliding_window=window,
        dtype=dtype,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        architecture=model_type,
    )


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the .safetensors file holding it."""
    from safetensors import safe_open

    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path}: no *.safetensors files")
    out = {}
    for f in files:
        with safe_open(str(f), framework="np") as st:
            out.update({name: f for name in st.keys()})
    return out


def read_hf_config(path: Path, dtype: str = "float32") -> ModelConfig:
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
        return config_from_hf(cfg, Path(path).name, dtype)
    except (OSError, ValueError, KeyError, ConfigError) as e:
        raise WeightsError(f"{Path(path) / 'config.json'}: unreadable or incomplete ({e})") \
            from None


def load_hf(path: Path, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """Read an HF directory: (ModelConfig, parameter tree of host numpy arrays in `dtype`)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    config = read_hf_config(path, dtype)
    try:
        files = _tensor_files(path)
        handles = {f: safe_open(str(f), framework="np") for f in set(files.values())}
    except (OSError, SafetensorError, ValueError, KeyError) as e:
        raise WeightsError(f"{path}: unreadable safetensors ({e}); download it again") from None

    def get(name: str) -> np.ndarray:
        return handles[files[name]].get_tensor(name)

    return config, params_from_hf(config, get, str(path))
