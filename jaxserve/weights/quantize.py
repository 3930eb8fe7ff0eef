"""int8 weight storage (ModelConfig.quantization "int8"), applied to loaded host weights.

Each decoder projection (jaxserve.executor.models.decoder.PROJECTIONS) becomes blocks, one row
per output channel, of INT8_GROUP rows of its flattened contraction axes each: an f32 scale and
minimum and INT8_GROUP uint8 codes, w ~= code * scale + min, scale = (max - min) / 255 over the
group (jaxserve.kernels.matmul FORMATS "int8": the GGUF blocks' layout, so the CPU kernel that
reads those in place reads these: 1.25 bytes a weight where f32 streams 4; elsewhere the model
dequantizes a layer inside the step).

Why asymmetric groups of 32: a Q4_1 (or Q4_0) GGUF block is 32 input rows holding 16 levels from
its minimum to its maximum (llama.cpp sets d = (max - min) / 15), so level k lands exactly on
code 17k and the weights come back as the f32 dequantization gave them, up to f32 rounding of the
product. From f32 / bf16 sources the error is at most half a step, (max - min) / 510 per group.
The embeddings / LM head stay in the model's dtype: the LM head reads the whole [vocab, hidden]
matrix at once, and a dequantized copy of it would not fit in cache.
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import INT8_GROUP
from jaxserve.executor.models.decoder import PROJECTIONS


def int8_blocks(w: np.ndarray) -> np.ndarray:
    """f32 [..., N, K] -> uint8 [..., N, K / INT8_GROUP * 40]: each row's groups of INT8_GROUP
    along K as (f32 scale, f32 minimum, the codes)."""
    groups = np.asarray(w, np.float32).reshape(*w.shape[:-1], -1, INT8_GROUP)
    low, high = groups.min(axis=-1, keepdims=True), groups.max(axis=-1, keepdims=True)
    scale = (high - low) / 255
    step = np.where(scale > 0, scale, 1.0)  # a constant group: all codes 0
    codes = np.rint((groups - low) / step).clip(0, 255).astype(np.uint8)
    blocks = np.concatenate([scale.view(np.uint8), low.view(np.uint8), codes], axis=-1)
    return blocks.reshape(*w.shape[:-1], -1)


def quantize_int8(params: dict) -> dict:
    """The host parameter tree with the layers' projections as int8 blocks [L, N, K / 32 * 40]
    (N the flattened output axes, K the contraction axes; see the module)."""
    layers = dict(params["layers"])
    for name, num_contract in PROJECTIONS.items():
        w = np.asarray(layers[name], np.float32)  # [L, *contraction, *out]
        k = int(np.prod(w.shape[1:1 + num_contract]))
        layers[name] = int8_blocks(w.reshape(w.shape[0], k, -1).transpose(0, 2, 1))
    return {**params, "layers": layers}
