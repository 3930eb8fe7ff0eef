"""int8 weight storage (ModelConfig.quantization "int8"), applied to loaded host weights.

Each decoder projection (jaxserve.executor.models.decoder.PROJECTIONS) becomes uint8 codes of its
shape and, per group of INT8_GROUP rows of its flattened contraction axes and per output channel, an
f32 scale and minimum: w ~= code * scale + min, scale = (max - min) / 255 over the group. The model
dequantizes a layer inside the step, so a decode step reads a quarter of the f32 bytes.

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


def quantize_int8(params: dict) -> dict:
    """The host parameter tree with the layers' projections as int8 groups (see the module)."""
    layers = dict(params["layers"])
    for name, num_contract in PROJECTIONS.items():
        w = np.asarray(layers[name], np.float32)  # [L, *contraction, *out]
        out_shape = w.shape[1 + num_contract:]
        groups = w.reshape(w.shape[0], -1, INT8_GROUP, *out_shape)
        low, high = groups.min(axis=2), groups.max(axis=2)
        scale = (high - low) / 255
        step = np.where(scale > 0, scale, 1.0)[:, :, None]  # a constant group: all codes 0
        codes = np.rint((groups - low[:, :, None]) / step).clip(0, 255).astype(np.uint8)
        layers[name] = codes.reshape(w.shape)
        layers[f"{name}_scale"], layers[f"{name}_min"] = scale, low
    return {**params, "layers": layers}
