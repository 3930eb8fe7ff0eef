"""GGUF (llama.cpp) checkpoints: metadata -> ModelConfig, dequantized tensors -> parameter tree.

Tensors are dequantized with the `gguf` package (the same routine HF transformers uses, so golden
outputs computed from this file are reproducible bit for bit up to float32 arithmetic).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import WeightsError
from jaxserve.weights.hf_layout import params_from_hf

# llama.cpp architectures this model covers. Mistral GGUFs are written as "llama".
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rope pairs -> HF's rotate-half halves).

    llama.cpp's converter regroups each head's rows (first half, second half) into interleaved
    pairs; reading them back as [head, pair, 2] and swapping the last two axes restores HF order.
    Works for weights [out, in] and biases [out].
    """
    rest = w.shape[1:]
    return (w.reshape(n_heads, -1, 2, *rest).swapaxes(1, 2).reshape(w.shape))


def _open(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise WeightsError(f"{path}: no such GGUF file")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader fails in many ways on bad bytes; the user needs one line
        raise WeightsError(
            f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); the file is corrupted or "
            f"truncated — download it again") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def config_from_gguf(reader, path: Path, dtype: str = "float32") -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise WeightsError(
            f"{path}: unsupported GGUF architecture {arch!r} (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1+ GGUFs bake rope scaling into a tensor of per-frequency factors instead of
        # metadata; load those models from their HF directory, whose config.json has the scaling.
        raise WeightsError(
            f"{path}: rope scaling stored as a rope_freqs tensor is not supported; load the HF "
            f"directory of this model instead")

    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise WeightsError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise WeightsError(f"{path}: GGUF metadata has neither {arch}.vocab_size nor a token list")
    eos = [_field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    window = _field(reader, f"{arch}.attention.sliding_window")
    return ModelConfig(
        name=str(_field(reader, "general.name", path.stem)),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=int(window) if window else None,
        dtype=dtype,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        architecture=arch,
    )


def read_gguf_config(path: Path, dtype: str = "float32") -> ModelConfig:
    """The ModelConfig alone (the tensors are memory-mapped, not read)."""
    return config_from_gguf(_open(Path(path)), Path(path), dtype)


def load_gguf(path: Path, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """Read a GGUF file: (ModelConfig, parameter tree of host numpy arrays in `dtype`)."""
    from gguf import quants

    path = Path(path)
    reader = _open(path)
    config = config_from_gguf(reader, path, dtype)
    by_hf_name = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is not None:
            by_hf_name[name] = t
    permute_heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}

    def get(name: str) -> np.ndarray:
        t = by_hf_name[name]
        try:
            w = quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise WeightsError(f"{path}: tensor {t.name} cannot be dequantized ({e})") from None
        proj = name.split(".")[-2]
        if config.architecture == "llama" and proj in permute_heads:
            w = _unpermute_rope(w, permute_heads[proj])
        return w

    return config, params_from_hf(config, get, str(path))
