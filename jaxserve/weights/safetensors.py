"""HF model directories: config.json (a model_type of jaxserve.weights.architectures) +
*.safetensors, sharded or not."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import ConfigError, WeightsError
from jaxserve.weights import fp8, mxfp4
from jaxserve.weights.architectures import config_from_hf, text_tensor_name
from jaxserve.weights.hf_layout import params_from_hf

INDEX_FILE = "model.safetensors.index.json"


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name (as stored) -> the .safetensors file holding it."""
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
    except ConfigError as e:  # one line naming what is not served
        raise WeightsError(f"{Path(path)}: {e}") from None
    except (OSError, ValueError, KeyError) as e:
        raise WeightsError(f"{Path(path) / 'config.json'}: unreadable or incomplete ({e})") \
            from None


def load_hf(path: Path, dtype: str = "float32",
            keep_bf16: bool = False) -> tuple[ModelConfig, dict]:
    """Read an HF directory: (ModelConfig, parameter tree of host numpy arrays in `dtype`).
    keep_bf16 (a float32 load): a checkpoint whose text tensors are all stored in bf16, as
    released models are, keeps its matmul weights bf16 (ModelConfig.weight_dtype: the same
    floats, half the bytes); any other dtype in the file (f32, f16, fp8, mxfp4) loads as
    before."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    config = read_hf_config(path, dtype)
    try:
        files = _tensor_files(path)
        handles = {f: safe_open(str(f), framework="np") for f in set(files.values())}
    except (OSError, SafetensorError, ValueError, KeyError) as e:
        raise WeightsError(f"{path}: unreadable safetensors ({e}); download it again") from None

    # A multimodal checkpoint's text tensors under the text model's names (the rest unread).
    cfg = json.loads((path / "config.json").read_text())
    stored = {text_tensor_name(name, cfg.get("model_type")): name for name in files}
    float8: dict[Path, fp8.Float8Reader] = {}
    quantization = cfg.get("quantization_config")
    if keep_bf16 and dtype == "float32" and quantization is None and all(
            handles[files[name]].get_slice(name).get_dtype() == "BF16"
            for name in stored.values()):
        config = config.replace(weight_dtype="bfloat16")

    def get(name: str) -> np.ndarray:
        file, name = files[stored[name]], stored[name]
        if handles[file].get_slice(name).get_dtype() in fp8.FLOAT8:
            reader = float8.get(file) or float8.setdefault(file, fp8.Float8Reader(file))
            return reader.get(name)
        return handles[file].get_tensor(name)

    # FP8 block-quantized checkpoints, MXFP4 experts (gpt-oss): each weight dequantized as it
    # is read.
    if mxfp4.is_mxfp4(quantization):
        get = mxfp4.dequantizing(get, set(stored))
    else:
        get = fp8.dequantizing(get, set(stored), fp8.block_size(quantization))
    return config, params_from_hf(config, get, str(path))
