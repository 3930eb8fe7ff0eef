"""FP8 block-quantized checkpoints, as DeepSeek-V3/R1 and the Qwen3 FP8 releases store them:
config.json's `quantization_config` {"quant_method": "fp8", "weight_block_size": [bm, bn], ...}
and, for each quantized Linear `X`, `X.weight` in float8_e4m3fn [out, in] beside
`X.weight_scale_inv` f32 [ceil(out / bm), ceil(in / bn)]: the weight is q * scale_inv of its
block (transformers' FineGrainedFP8 format; its Fp8Quantize writes these two tensors).

jaxserve dequantizes at load, on every platform: each quantized tensor is read, multiplied by its
blocks' scales in f32 and handed to the layout code as any HF tensor, one tensor at a time (never
the whole checkpoint twice). There is no FP8 matmul kernel yet, so the weights sit in memory in
the model's dtype (twice the FP8 bytes in bf16). Which tensors were quantized is read off the
checkpoint itself (a weight with a `weight_scale_inv` beside it), so `modules_to_not_convert`
needs no interpreting. Activations are not quantized: "dynamic" activation scaling (every
release's) quantizes them per token on the fly in FP8 kernels, which dequantized weights do not
need; "static" scales are refused.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

from jaxserve.errors import ConfigError, WeightsError

QUANT_METHODS = ("fp8",)  # the quantization_config quant_method values jaxserve reads
_SCALE = "_scale_inv"  # `X.weight` + this: the weight's per-block scales
_KNOWN_KEYS = frozenset({"quant_method", "weight_block_size", "activation_scheme", "fmt",
                         "scale_fmt", "modules_to_not_convert", "ignored_layers"})


def block_size(quantization_config: dict | None) -> tuple[int, int] | None:
    """(bm, bn) of an FP8 block-quantized checkpoint's quantization_config, None without one;
    a ConfigError in one line for any other quantization (method, scheme or key)."""
    q = quantization_config
    if q is None:
        return None
    if not isinstance(q, dict) or q.get("quant_method") not in QUANT_METHODS:
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise ConfigError(f"quantization_config quant_method {method!r} is not supported "
                          f"(supported: fp8 with weight_block_size)")
    unknown = sorted(k for k, v in q.items() if k not in _KNOWN_KEYS and v is not None)
    block = q.get("weight_block_size")
    why = (f"keys {unknown}" if unknown else
           "no weight_block_size (per-tensor scales)" if block is None else
           f"activation_scheme {q.get('activation_scheme')!r}"
           if q.get("activation_scheme", "dynamic") != "dynamic" else
           f"fmt {q.get('fmt')!r}" if q.get("fmt", "e4m3") != "e4m3" else None)
    if why is None and not (isinstance(block, list) and len(block) == 2
                            and all(isinstance(b, int) and b > 0 for b in block)):
        why = f"weight_block_size {block!r}"
    if why is not None:
        raise ConfigError(f"fp8 quantization_config with {why} is not supported (supported: "
                          f"e4m3 weights in blocks, dynamic activations)")
    return block[0], block[1]


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """q [..., out, in] (float8_e4m3fn) times its blocks' scale_inv [..., ceil(out / bm),
    ceil(in / bn)] (f32, or uint8 E8M0 exponents): f32 [..., out, in]. A last block may be
    partial (DeepSeek-V3's 576-row kv_a_proj_with_mqa in blocks of 128)."""
    (bm, bn), (rows, cols) = block, weight.shape[-2:]
    want = (*weight.shape[:-2], math.ceil(rows / bm), math.ceil(cols / bn))
    if scale_inv.shape != want:
        raise WeightsError(f"weight_scale_inv of shape {scale_inv.shape} for a weight of shape "
                           f"{weight.shape} in blocks of {list(block)} (want {want})")
    if scale_inv.dtype == np.uint8:  # E8M0: a power of two by its biased exponent
        scale_inv = np.exp2(scale_inv.astype(np.float32) - 127.0)
    scales = np.repeat(np.repeat(scale_inv.astype(np.float32), bm, axis=-2), bn, axis=-1)
    return weight.astype(np.float32) * scales[..., :rows, :cols]


def dequantizing(get: Callable[[str], np.ndarray], names: set[str],
                 block: tuple[int, int] | None) -> Callable[[str], np.ndarray]:
    """`get` (tensor by HF name) with each quantized weight dequantized as it is read. `names`:
    every tensor in the checkpoint. Without a block size (no quantization_config), an FP8 tensor
    is refused: its scales would be guesses."""
    def read(name: str) -> np.ndarray:
        tensor = get(name)
        if block is not None and name + _SCALE in names:
            if tensor.dtype != ml_dtypes.float8_e4m3fn:
                raise WeightsError(f"{name} has a weight_scale_inv but is {tensor.dtype}, not "
                                   f"float8_e4m3fn")
            return dequantize(tensor, get(name + _SCALE), block)
        if tensor.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
            raise WeightsError(f"{name} is {tensor.dtype} without a weight_scale_inv and an fp8 "
                               f"quantization_config: its scale is unknown")
        return tensor

    return read


# safetensors' numpy reader has no float8 (numpy lacks the dtype): these tensors are read by the
# file's header, as ml_dtypes arrays over a memory map.
FLOAT8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


class Float8Reader:
    """The float8 tensors of one .safetensors file (the header read once)."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise WeightsError(f"{path}: safetensors header of {size} bytes")
            self.header = json.loads(f.read(size))
        self.data_start = 8 + size

    def get(self, name: str) -> np.ndarray:
        entry = self.header[name]
        start, end = entry["data_offsets"]
        data = np.memmap(self.path, np.uint8, "r", offset=self.data_start + start,
                         shape=(end - start,))
        return np.array(data).view(FLOAT8[entry["dtype"]]).reshape(entry["shape"])
