"""jaxserve: LLM serving on JAX."""

__version__ = "0.1.0"
