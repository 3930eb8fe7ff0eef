"""jaxserve: LLM serving on JAX."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    # Lazy, so `import jaxserve` (the CLI, the scheduler tests) does not pay for JAX.
    if name == "LLM":
        from jaxserve.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from jaxserve.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
