"""Reasoning: a thinking model's reasoning told apart from its answer (`parsers`: per model
family, whole texts and streams). The serving layer returns it as `reasoning_content` in chat
completions and as reasoning items in /v1/responses. Pure Python, no JAX."""
