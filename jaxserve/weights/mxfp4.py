"""MXFP4 checkpoints, as the released gpt-oss checkpoints store their experts: config.json's
`quantization_config` {"quant_method": "mxfp4", "modules_to_not_convert": [...]} and, for each
quantized expert weight `X` ([E, in, out] in the unquantized checkpoint), `X_blocks` uint8
[E, out, in / 32, 16] (two FP4 e2m1 values per byte, the low nibble first) beside `X_scales` uint8
[E, out, in / 32] (E8M0: the block of 32 values is scaled by 2 ** (scale - 127)). This is what
transformers' `convert_moe_packed_tensors` reads (its result transposed back to [E, in, out]).

jaxserve dequantizes at load, on every platform, one tensor at a time as it is read: every FP4
value times a power of two is exact in bf16 and f32, so the loaded model is exactly the one
whose expert weights are the dequantized values. There is no MXFP4 matmul kernel yet, so the
experts sit in memory in the model's dtype (4x the MXFP4 bytes in bf16). `quantize` writes the
format (tools/make_mxfp4_fixture.py uses it).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxserve.errors import ConfigError, WeightsError

QUANT_METHOD = "mxfp4"
BLOCK = 32  # values per scale
BLOCKS, SCALES = "_blocks", "_scales"  # `X` + these: the quantized weight's two tensors
# The 16 e2m1 codes' values (sign bit 3, then two exponent bits and one mantissa bit).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
_KNOWN_KEYS = frozenset({"quant_method", "modules_to_not_convert", "dequantize"})


def is_mxfp4(quantization_config: dict | None) -> bool:
    """Whether a quantization_config is MXFP4's (checked: a key that may change the math is a
    ConfigError naming it); False for none or another method."""
    q = quantization_config
    if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD:
        return False
    unknown = sorted(k for k, v in q.items() if k not in _KNOWN_KEYS and v is not None)
    if unknown:
        raise ConfigError(f"mxfp4 quantization_config keys jaxserve does not implement: "
                          f"{', '.join(unknown)}")
    return True


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., rows, G, 16] and scales uint8 [..., rows, G] -> f32 [..., rows, G * 32]
    (the quantized axis last, as stored)."""
    if (blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.ndim < 2
            or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape):
        raise WeightsError(f"MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales "
                           f"{scales.dtype}{list(scales.shape)} do not fit (want uint8 [..., G, "
                           f"{BLOCK // 2}] and uint8 [..., G])")
    values = np.empty((*blocks.shape[:-1], BLOCK), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`dequantize`'s inverse up to rounding: w [..., rows, K] (K a multiple of 32) -> (blocks,
    scales). Each block's scale is the smallest power of two that fits its largest magnitude in
    FP4's 6; values round to the nearest FP4 value."""
    w = np.asarray(w, np.float32)
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = np.abs(blocks).max(-1)
    exponent = np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / 6.0)).astype(np.int32)
    exponent = np.clip(exponent, -127, 127)
    scaled = blocks / np.ldexp(np.float32(1.0), exponent)[..., None]
    codes = np.abs(np.abs(scaled)[..., None] - FP4_VALUES[:8]).argmin(-1).astype(np.uint8)
    codes |= np.where(scaled < 0, 8, 0).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # C order: safetensors' numpy writer stores an array's buffer as it lies.
    return np.ascontiguousarray(packed), np.ascontiguousarray(exponent + 127, np.uint8)


def dequantizing(get: Callable[[str], np.ndarray], names: set[str]
                 ) -> Callable[[str], np.ndarray]:
    """`get` (tensor by HF name) where a weight `X` stored as `X_blocks` + `X_scales` (`names`:
    every tensor in the checkpoint) reads dequantized, in the unquantized checkpoint's layout
    [..., in, out]."""

    def read(name: str) -> np.ndarray:
        if name in names or name + BLOCKS not in names:
            return get(name)
        return np.swapaxes(dequantize(get(name + BLOCKS), get(name + SCALES)), -1, -2)

    return read
