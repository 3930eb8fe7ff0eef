"""HF BERT directories (config.json + model.safetensors) -> the tree of
jaxserve.executor.models.bert."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from jaxserve.errors import ConfigError, WeightsError
from jaxserve.executor.models.bert import BertConfig

# Our name -> the HF module under encoder.layer.{i}.
_DENSE = {"query": "attention.self.query", "key": "attention.self.key",
          "value": "attention.self.value", "attention_out": "attention.output.dense",
          "intermediate": "intermediate.dense", "output": "output.dense"}
_NORMS = {"attention_norm": "attention.output.LayerNorm", "output_norm": "output.LayerNorm"}


def _norm(get, prefix: str) -> dict:
    # Checkpoints converted from TF name LayerNorm parameters gamma/beta instead of weight/bias.
    try:
        return {"scale": get(f"{prefix}.weight"), "bias": get(f"{prefix}.bias")}
    except KeyError:
        return {"scale": get(f"{prefix}.gamma"), "bias": get(f"{prefix}.beta")}


def load_bert(directory: Path) -> tuple[BertConfig, dict]:
    """(config, params as host float32 numpy arrays) of a BERT model directory."""
    from safetensors import safe_open

    directory = Path(directory)
    try:
        config = BertConfig.from_hf(json.loads((directory / "config.json").read_text()))
    except (OSError, json.JSONDecodeError, KeyError, ConfigError) as e:
        raise WeightsError(f"{directory}: unusable BERT config.json: {e}") from None
    path = directory / "model.safetensors"
    try:
        with safe_open(str(path), framework="np") as st:
            names = set(st.keys())
            # Some exports prefix every tensor with the "bert." of BertForX models.
            prefix = "bert." if "bert.embeddings.word_embeddings.weight" in names else ""

            def get(name: str) -> np.ndarray:
                if prefix + name not in names:
                    raise KeyError(name)
                return st.get_tensor(prefix + name).astype(np.float32)

            def layer(i: int) -> dict:
                base = f"encoder.layer.{i}"
                out = {ours: {"kernel": get(f"{base}.{hf}.weight").T,
                              "bias": get(f"{base}.{hf}.bias")} for ours, hf in _DENSE.items()}
                out.update({ours: _norm(get, f"{base}.{hf}") for ours, hf in _NORMS.items()})
                return out

            layers = [layer(i) for i in range(config.num_layers)]
            params = {
                "word_embeddings": get("embeddings.word_embeddings.weight"),
                "position_embeddings": get("embeddings.position_embeddings.weight"),
                "token_type_embeddings": get("embeddings.token_type_embeddings.weight"),
                "embeddings_norm": _norm(get, "embeddings.LayerNorm"),
            }
    except KeyError as e:
        raise WeightsError(f"{path}: missing tensor {e.args[0]} of a BERT model") from None
    except OSError as e:
        raise WeightsError(f"{path}: unreadable safetensors file: {e}") from None
    params["layers"] = jax.tree.map(lambda *xs: np.stack(xs), *layers)
    return config, params
