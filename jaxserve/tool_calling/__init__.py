"""Tool calling: the `tools` / `tool_choice` of a request (`functions`), tools in the chat prompt
(`prompt`: the model's template or a Hermes-style fallback), tool-call parsers per model family
(`parsers`, whole texts and streams), and forced calls for tool_choice "required"/named
(`choice`, a structured-output constraint). Pure Python, no JAX."""
