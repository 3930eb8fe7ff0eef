"""Structured outputs: grammar-constrained decoding.

`params` holds the constraint a request carries (no JAX, no grammar library); `grammar` compiles
it with llguidance for a tokenizer (cached), keeps each sequence's matcher and fills the per-row
token bitmasks the device sampler applies (`jaxserve.executor.sampler.apply_token_bitmask`).
"""

from jaxserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
